"""One weight format per role: what each engine packs and what every pass runs in.

A prefill engine holds only its prefill format, a decode engine only its decode format and
runs every pass in it (a 64-token local prefill chunk mixed into its batch, a 40-request decode
batch): its output for a row equals that row computed alone. Only a colocated engine may hold
both, and then picks by phase (prompt-only pass -> prefill copy, any decode token -> decode
copy), never by the size of the pass. Each pass's formats are seen by recording the `fmt` of
every `linear` call the model makes.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, role_formats
from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk
from engine.models import llama as llama_module
from engine.models.llama import LM_HEAD_FORMAT
from worker.config import WorkerConfig
from worker.flags import worker_arg_parser
from worker.node_server import build_engine
from common.sampling_params import SamplingParams
from reliability.model_factory import make_tiny_hf_model

BLOCK = 16
VOCAB = 320
ATOL = 1e-4  # fp32 rounding of a different batch shape; a format switch is orders larger


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("roles") / "tiny", vocab_size=VOCAB, seed=11)


def engine_for(model_dir, role, decode, prefill, num_blocks=256,
               scheduler=SchedulerConfig()) -> LLMEngine:
    return LLMEngine.from_path(model_dir, EngineConfig.for_role(
        role, decode, prefill, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=scheduler), load_tokenizer=False)


def packed_formats(model) -> set[str]:
    """Formats of every PackedLinear the model holds, in any copy."""
    found = set()
    for value in vars(model).values():
        copies = [value] if isinstance(value, llama_module.FormatSet) else []
        for copy in copies:
            found.add(copy.lm_head.fmt)
            for layer in copy.layers:
                found.update(p.fmt for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    return found


@pytest.fixture
def recorded(monkeypatch):
    """The `fmt` of every linear the model runs, call by call, through the Python layer loop
    (the native decode path is off: it runs the same copy's kernels in one call, equal bit for
    bit, tests/engine/test_native_decode.py, but makes no call to record here)."""
    calls: list[str] = []
    original = llama_module.linear
    monkeypatch.setattr(llama_module.NativeDecode, "build", classmethod(lambda cls, model: None))

    def recording(x, packed):
        calls.append(packed.fmt)
        return original(x, packed)

    monkeypatch.setattr(llama_module, "linear", recording)
    return calls


def layer_and_head_calls(calls: list[str], num_layers: int) -> tuple[set[str], set[str]]:
    """Split one pass's recorded calls (4 projections per layer, then the lm_head)."""
    n = 4 * num_layers
    return set(calls[:n]), set(calls[n:])


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


def run_pass(engine: LLMEngine, chunks: list[SequenceChunk]):
    """One forward pass on the engine's runner: (hidden [T, H], logits of every row)."""
    batch = engine.runner.prepare(chunks)
    with torch.inference_mode():
        hidden = engine.model.forward(batch, engine.runner.kv_cache)
        logits = engine.model.compute_logits(hidden, batch)
    return batch, hidden, logits


def assert_rows_equal_alone(engine: LLMEngine, chunks: list[SequenceChunk]) -> None:
    """Every row of the batched pass equals the same chunk run alone (batch of 1)."""
    batch, hidden, logits = run_pass(engine, chunks)
    cu = batch.cu_seqlens_q.tolist()
    for i, chunk in enumerate(chunks):
        _, alone_hidden, alone_logits = run_pass(engine, [chunk])
        torch.testing.assert_close(hidden[cu[i]:cu[i + 1]], alone_hidden, atol=ATOL, rtol=ATOL,
                                   msg=lambda m: f"chunk {i} ({len(chunk.token_ids)} tokens): {m}")
        torch.testing.assert_close(logits[cu[i]:cu[i + 1]], alone_logits, atol=ATOL, rtol=ATOL)


class Sequences:
    """Sequences with their prompts already in the cache, each in its own blocks."""

    def __init__(self, engine: LLMEngine, n: int, prompt_len: int, blocks_each: int, seed: int) -> None:
        self.engine = engine
        self.tokens = prompts(n, prompt_len, seed)
        self.tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(n)]
        for ids, table in zip(self.tokens, self.tables):
            engine.runner.execute([SequenceChunk(ids, 0, table, True, is_decode=False)])

    def decode(self, i: int, token: int = 7) -> SequenceChunk:
        return SequenceChunk([token], len(self.tokens[i]), self.tables[i], True, is_decode=True)


# -- what each role packs -----------------------------------------------------------------

@pytest.mark.parametrize("decode,prefill", [("int8", "fp32"), ("int4", "w8a8"), ("int4a8", "w8a8"),
                                            ("fp32", "bf16")])
def test_decode_role_holds_only_the_decode_format(model_dir, decode, prefill):
    engine = engine_for(model_dir, "decode", decode, prefill)
    model = engine.model
    assert model.formats == (decode,)
    assert model.prefill_copy is None
    assert packed_formats(model) == {decode, LM_HEAD_FORMAT[decode]}
    assert {lin.fmt for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)} == {decode}
    assert engine.config.role == "decode"
    assert (engine.config.weight_format, engine.config.prefill_weight_format) == (decode, None)


@pytest.mark.parametrize("decode,prefill", [("int4", "w8a8"), ("int8", "fp32"), ("int4", "bf16")])
def test_prefill_role_holds_only_the_prefill_format(model_dir, decode, prefill):
    engine = engine_for(model_dir, "prefill", decode, prefill)
    assert engine.model.formats == (prefill,)
    assert engine.model.prefill_copy is None
    assert packed_formats(engine.model) == {prefill, LM_HEAD_FORMAT[prefill]}
    assert (engine.config.weight_format, engine.config.prefill_weight_format) == (prefill, None)


def test_colocated_holds_both_only_when_they_differ(model_dir):
    both = engine_for(model_dir, "colocated", "int8", "fp32")
    assert both.model.formats == ("int8", "fp32")
    assert packed_formats(both.model) == {"int8", "fp32"}
    one = engine_for(model_dir, "colocated", "int8", "int8")
    assert one.model.formats == ("int8",) and one.model.prefill_copy is None
    assert engine_for(model_dir, "colocated", "fp32", None).model.formats == ("fp32",)


def test_roles_are_validated(model_dir):
    assert role_formats("prefill", "int4", "w8a8") == ("w8a8", None)
    assert role_formats("decode", "int4", "w8a8") == ("int4", None)
    assert role_formats("colocated", "int4", "w8a8") == ("int4", "w8a8")
    with pytest.raises(ValueError, match="role"):
        role_formats("both", "int4", "fp32")
    both = engine_for(model_dir, "colocated", "int8", "fp32", num_blocks=8)
    with pytest.raises(ValueError, match="colocated engines only"):
        EngineConfig(model=both.config.model, role="decode", weight_format="int8",
                     prefill_weight_format="fp32")
    with pytest.raises(ValueError, match="one weight format"):
        LLMEngine(both.model, EngineConfig(model=both.config.model, role="decode",
                                           cache=CacheConfig(block_size=BLOCK, num_blocks=8),
                                           weight_format="int8"))


def test_node_processes_build_their_role_only(model_dir):
    """The worker entry points' engine construction (worker/node_server.build_engine)."""
    flags = ["--model", str(model_dir), "--port", "1", "--prefill-quant", "w8a8",
             "--decode-quant", "int8", "--num-blocks", "8", "--block-size", str(BLOCK)]

    def built(prog, roles, *extra) -> tuple[str, ...]:
        args = worker_arg_parser(prog, roles).parse_args(flags + list(extra))
        return build_engine(WorkerConfig.from_args(args), model_dir).model.formats

    assert built("prefill_node", ("prefill",)) == ("w8a8",)
    assert built("decode_node", ("decode", "colocated"), "--role", "decode") == ("int8",)
    assert built("decode_node", ("decode", "colocated"), "--role", "colocated") == ("int8", "w8a8")


# -- what every pass runs in --------------------------------------------------------------

@pytest.mark.parametrize("decode,prefill", [("fp32", "w8a8"), ("fp32", "bf16")])
def test_decode_role_rows_do_not_depend_on_the_batch(model_dir, decode, prefill):
    """A 64-token local prefill chunk beside decodes, and a 40-sequence decode batch: each row
    is what that sequence computes alone. (Under a size rule, 32+ tokens would switch these
    passes to the prefill copy and the rows would differ by the format's error.)"""
    engine = engine_for(model_dir, "decode", decode, prefill, num_blocks=512)
    seqs = Sequences(engine, 40, prompt_len=9, blocks_each=2, seed=1)
    long_prompt = prompts(1, 64, seed=2)[0]
    long_table = list(range(480, 484))
    mixed = [seqs.decode(0), SequenceChunk(long_prompt, 0, long_table, True, is_decode=False),
             seqs.decode(1), seqs.decode(2)]
    assert_rows_equal_alone(engine, mixed)
    assert_rows_equal_alone(engine, [seqs.decode(i) for i in range(40)])


@pytest.mark.parametrize("decode,prefill", [("int4", "fp32"), ("int8", "w8a8"), ("fp32", "bf16")])
def test_decode_role_runs_every_pass_in_the_decode_format(model_dir, recorded, decode, prefill):
    engine = engine_for(model_dir, "decode", decode, prefill, num_blocks=512)
    layers = engine.config.model.num_layers
    seqs = Sequences(engine, 40, prompt_len=9, blocks_each=2, seed=3)
    passes = {
        "64-token chunk + decodes": [seqs.decode(0), seqs.decode(1),
                                     SequenceChunk(prompts(1, 64, seed=4)[0], 0, list(range(480, 484)), True,
                                                   is_decode=False)],
        "40 decodes": [seqs.decode(i) for i in range(40)],
        "prompt alone": [SequenceChunk(prompts(1, 48, seed=5)[0], 0, list(range(484, 487)), True,
                                       is_decode=False)],
    }
    for name, chunks in passes.items():
        recorded.clear()
        engine.runner.execute(chunks)
        layer_fmts, head_fmts = layer_and_head_calls(recorded, layers)
        assert layer_fmts == {decode}, name
        assert head_fmts == {LM_HEAD_FORMAT[decode]}, name


def test_decode_role_engine_loop_stays_in_the_decode_format(model_dir, recorded):
    """Through engine.step: local prefills (split-fuse beside running decodes) and a
    40-request batch never leave the decode format, and each request's tokens are those it
    generates alone."""
    engine = engine_for(model_dir, "decode", "fp32", "w8a8", num_blocks=512,
                        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=64,
                                                  long_prefill_token_threshold=64))
    batch_prompts = prompts(40, 12, seed=6) + prompts(2, 100, seed=7)
    reqs = [engine.add_request(p, SamplingParams(temperature=0.0, num_predict=4), stop_token_ids=frozenset())
            for p in batch_prompts]
    outputs = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert set(recorded) == {"fp32"}
    alone = engine_for(model_dir, "decode", "fp32", "w8a8")
    for r, p in zip(reqs[::7], batch_prompts[::7]):
        assert outputs[r.request_id] == list(alone.generate(p, SamplingParams(temperature=0.0, num_predict=4)))


def test_prefill_role_runs_every_pass_in_the_prefill_format(model_dir, recorded):
    engine = engine_for(model_dir, "prefill", "int4", "w8a8", num_blocks=64)
    layers = engine.config.model.num_layers
    for chunks in ([SequenceChunk(prompts(1, 5, seed=8)[0], 0, [0], True, is_decode=False)],
                   [SequenceChunk(p, 0, [1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i], True, is_decode=False)
                    for i, p in enumerate(prompts(4, 60, seed=9))]):
        recorded.clear()
        engine.runner.execute(chunks)
        assert layer_and_head_calls(recorded, layers) == ({"w8a8"}, {"int8"})


def test_colocated_picks_by_phase_not_size(model_dir, recorded):
    """Prompt-only passes run in the prefill copy (even a 1-token prompt chunk); a pass with
    any decode token runs in the decode copy (even with a 64-token prompt chunk in it, even
    40 decodes)."""
    engine = engine_for(model_dir, "colocated", "int8", "fp32", num_blocks=512)
    layers = engine.config.model.num_layers
    seqs = Sequences(engine, 40, prompt_len=9, blocks_each=2, seed=10)
    cases = [
        ("one-token prompt chunk", [SequenceChunk([5], 0, [480], True, is_decode=False)], "fp32"),
        ("prompts only", [SequenceChunk(p, 0, list(range(481 + 4 * i, 485 + 4 * i)), True, is_decode=False)
                          for i, p in enumerate(prompts(2, 50, seed=11))], "fp32"),
        ("one decode", [seqs.decode(0)], "int8"),
        ("64-token chunk + a decode", [SequenceChunk(prompts(1, 64, seed=12)[0], 0, list(range(489, 493)), True,
                                                     is_decode=False), seqs.decode(1)], "int8"),
        ("40 decodes", [seqs.decode(i) for i in range(40)], "int8"),
    ]
    for name, chunks, fmt in cases:
        recorded.clear()
        engine.runner.execute(chunks)
        assert layer_and_head_calls(recorded, layers) == ({fmt}, {LM_HEAD_FORMAT[fmt]}), name


def test_colocated_engine_marks_decode_chunks(model_dir, recorded):
    """engine.step tells the runner which chunks are decodes: a lone request's prompt passes
    run in the prefill copy, its decode steps in the decode copy."""
    engine = engine_for(model_dir, "colocated", "int8", "fp32", num_blocks=64)
    layers = engine.config.model.num_layers
    engine.add_request(prompts(1, 20, seed=13)[0], SamplingParams(temperature=0.0, num_predict=3),
                       stop_token_ids=frozenset())
    per_pass = []
    while engine.has_unfinished():
        recorded.clear()
        engine.step()
        if recorded:
            per_pass.append(layer_and_head_calls(recorded, layers))
    assert per_pass == [({"fp32"}, {"fp32"})] + [({"int8"}, {"int8"})] * 2


def test_a_decode_worker_gives_its_threads_to_the_native_pool_and_one_to_torch(model_dir):
    import torch

    from kernels import native
    from worker.runtime import configure_process

    flags = ["--model", str(model_dir), "--port", "1", "--threads", "2", "--num-blocks", "8",
             "--block-size", str(BLOCK)]
    try:
        for prog, roles, extra, want_torch in (
                ("decode_node", ("decode", "colocated"), ["--role", "decode"], 1),
                ("prefill_node", ("prefill",), [], 2),
                ("decode_node", ("decode", "colocated"), ["--role", "colocated"], 2)):
            args = worker_arg_parser(prog, roles).parse_args(flags + extra)
            build_engine(WorkerConfig.from_args(args), model_dir)
            assert (torch.get_num_threads(), native.threads()) == (want_torch, 2), prog
    finally:
        configure_process(1)
