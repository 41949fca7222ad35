"""engine/native_decode.py: a decode pass's layers in one native call give the same bits as the
Python layer loop (engine/models/llama.py), for every native layout and model option it takes,
at every batch size and thread count; passes and models it does not take fall back to the loop.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.loaders import load_model
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from kernels import native, quant_int4
from reliability.model_factory import make_tiny_gguf

BS = 16
PROMPT = list(range(3, 60))


@pytest.fixture(autouse=True)
def native_int4(monkeypatch):
    """The native int4 layout whatever this host's layout choice (aten's has no native path)."""
    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "q4_1")
    yield
    native.set_threads(1)


def build(tmp_path, fmt="int4", ggml_type="Q4_1", arch="llama", **shape):
    shape = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "layers": 3, "vocab_size": 320,
             **shape}
    loaded = load_model(make_tiny_gguf(tmp_path / f"{arch}-{ggml_type}.gguf", ggml_type, arch=arch, **shape).path)
    return model_class(loaded.config.architecture)(loaded.config, loaded.weights, fmt)


def decode_run(model, batch: int, steps: int, kv_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `steps` decode passes of `batch` sequences (each after a prompt of its own
    length), and the KV cache after them."""
    runner = ModelRunner(model, CacheConfig(block_size=BS, num_blocks=8 * batch), kv_dtype, cuda_graphs=False)
    tables = [list(range(8 * i, 8 * (i + 1))) for i in range(batch)]
    for i in range(batch):
        runner.execute([SequenceChunk(PROMPT[:40 + i], 0, tables[i], False)])
    logits = [runner.execute([SequenceChunk([7 + s + i], 40 + i + s, tables[i], True) for i in range(batch)])
              for s in range(steps)]
    return torch.stack(logits), runner.kv_cache


def both_ways(model, batch, steps=4, kv_dtype=torch.float32):
    assert model.native_decode is not None
    fast = decode_run(model, batch, steps, kv_dtype)
    kept, model.native_decode = model.native_decode, None
    try:
        slow = decode_run(model, batch, steps, kv_dtype)
    finally:
        model.native_decode = kept
    return fast, slow


def assert_same_bits(fast, slow):
    assert torch.equal(fast[0], slow[0]), (fast[0] - slow[0]).abs().max()
    assert torch.equal(fast[1], slow[1])  # every layer's K and V written alike


@pytest.mark.parametrize("fmt,ggml_type", [("int4", "Q4_1"), ("int4a8", "Q4_1"), ("int8", "F32"),
                                           ("int4", "Q4_K"), ("int8", "Q6_K"), ("int8", "Q8_0"),
                                           ("int8", "Q5_K")])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_each_native_layout_decodes_the_same_bits_as_the_loop(tmp_path, fmt, ggml_type, batch):
    assert_same_bits(*both_ways(build(tmp_path, fmt, ggml_type), batch))


def test_a_q8_0_file_reads_its_own_blocks(tmp_path):
    """Under the default int4 format a Q8_0 file's matrices take int8's "q8_0" layout (the
    file's values and scales, engine/format_choice.py), and the native pass runs them."""
    model = build(tmp_path, "int4", "Q8_0")
    layers = model.layers
    assert {p.layout for layer in layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)} == {"q8_0"}
    assert_same_bits(*both_ways(model, 3))


def test_a_q4_k_m_mix_with_stacked_projections(tmp_path):
    """Q4_K with Q6_K attn_v (a q|k|v stack of three kernels) and ffn_down, bf16 KV."""
    model = build(tmp_path, "int4", "Q4_K", types={"attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"})
    assert model.layers[0].qkv.fmt == "stack"
    assert_same_bits(*both_ways(model, 3, kv_dtype=torch.bfloat16))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_biases_and_per_head_q_k_norms(tmp_path, arch):
    assert_same_bits(*both_ways(build(tmp_path, "int4", "Q4_1", arch=arch, head_dim=64), 2))


@pytest.mark.parametrize("threads", [2, 4])
def test_the_same_bits_at_every_thread_count(tmp_path, threads):
    model = build(tmp_path)
    serial = decode_run(model, 3, 3)
    native.set_threads(threads)
    assert_same_bits(decode_run(model, 3, 3), serial)
    assert_same_bits(*both_ways(model, 3, 3))


def test_passes_and_models_it_does_not_take_run_the_loop(tmp_path, monkeypatch):
    model = build(tmp_path)
    calls = []
    real = model.native_decode.run
    monkeypatch.setattr(model.native_decode, "run", lambda *a: calls.append(real(*a)) or calls[-1])
    runner = ModelRunner(model, CacheConfig(block_size=BS, num_blocks=16), torch.float32, cuda_graphs=False)
    runner.execute([SequenceChunk(PROMPT[:20], 0, [0, 1], False)])  # a prompt chunk: the loop
    runner.execute([SequenceChunk([5], 20, [0, 1], True), SequenceChunk(PROMPT[:9], 0, [2], True)])  # mixed
    runner.execute([SequenceChunk([5], 21, [0, 1], True)], lambda i: None)  # a KV listener (on_layer_done)
    runner.execute([SequenceChunk([5], 22, [0, 1], True)])  # a pure decode pass: native
    assert [c is not None for c in calls] == [False, False, False, True]
    # int4 pads a K of 80 to whole groups of 32: the path takes unpadded layers only.
    assert build(tmp_path, "int4", "F32", hidden=80, heads=2, kv_heads=2, head_dim=40).native_decode is None
    assert build(tmp_path, "fp32", "F32").native_decode is None
    # A model with aten's int4 layout (a torch op) has no native path.
    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "cpu")
    assert build(tmp_path).native_decode is None


def test_the_default_model_decodes_the_same_bits(default_gguf):
    loaded = load_model(default_gguf)
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, "int4")
    assert_same_bits(*both_ways(model, 2, steps=3))


@pytest.mark.parametrize("native_path", [True, False])
def test_a_speculative_verification_is_attended_as_decodes_row_by_row(tmp_path, monkeypatch,
                                                                      native_path):
    """A verification chunk (its last token and drafts; engine/speculative.py) is attended row
    by row as one-token decodes (ForwardBatch.rows_as_decodes): the native call takes the pass
    whole, and row i's logits and KV are the bits a plain decode step at that position gives,
    on the native path and on the loop."""
    model = build(tmp_path)
    if not native_path:
        monkeypatch.setattr(model, "native_decode", None)
    calls = []
    if native_path:
        real = model.native_decode.run
        monkeypatch.setattr(model.native_decode, "run", lambda *a: calls.append(real(*a)) or calls[-1])
    table, fed = list(range(8)), [7, 8, 9, 10]

    def runner() -> ModelRunner:
        r = ModelRunner(model, CacheConfig(block_size=BS, num_blocks=8), torch.float32, cuda_graphs=False)
        r.execute([SequenceChunk(PROMPT[:40], 0, table, False)])
        return r

    plain = runner()
    steps = [plain.execute([SequenceChunk([t], 40 + i, table, True, is_decode=True)])
             for i, t in enumerate(fed)]
    calls.clear()
    spec = runner()
    rows = spec.execute([SequenceChunk(fed, 40, table, True, num_logits=len(fed), is_decode=True)])
    assert torch.equal(rows, torch.cat(steps))
    assert torch.equal(spec.kv_cache, plain.kv_cache)
    if native_path:
        assert [c is not None for c in calls] == [False, True]  # the prompt, the verification
