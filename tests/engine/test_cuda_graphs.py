"""engine/cuda_graphs.py's buckets, padding and static buffers, run eagerly on the CPU.

Capture needs CUDA (the device check, benchmarks/device_check.py, runs it there); everything
around it, which decides what a replay computes, is the same code with `capture=False`:
a padded step must give the unpadded step's logits and leave the KV pool exactly as the
unpadded step leaves it (padding rows write nothing).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig
from engine.cuda_graphs import DecodeGraphRunner
from common.hf_config import hf_model_config
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from reliability.model_factory import build_tiny_hf


@pytest.fixture(scope="module")
def model():
    hf = build_tiny_hf("llama", vocab_size=160, hidden=64, layers=2, heads=4, kv_heads=2,
                       intermediate=96, seed=5)
    return model_class("llama")(hf_model_config(hf.config.to_dict()), dict(hf.state_dict()), "fp32")


def prefilled(model, prompts: list[list[int]]) -> tuple[ModelRunner, list[SequenceChunk]]:
    """A runner whose cache holds `prompts` (sequence i in blocks 2i+1, 2i+2), and each
    sequence's next decode chunk."""
    runner = ModelRunner(model, CacheConfig(block_size=4, num_blocks=24))
    tables = [[2 * i + 1, 2 * i + 2] for i in range(len(prompts))]
    logits = runner.execute([SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables)])
    return runner, [SequenceChunk([int(logits[i].argmax())], len(p), t, True, is_decode=True)
                    for i, (p, t) in enumerate(zip(prompts, tables))]


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_padded_bucket_matches_unpadded_step_and_writes_no_padding_kv(model, num_seqs):
    prompts = [[(7 * i + j) % 150 + 3 for j in range(3 + i)] for i in range(num_seqs)]
    plain, chunks = prefilled(model, prompts)
    padded, _ = prefilled(model, prompts)
    graphs = DecodeGraphRunner(model, padded.kv_cache, capture=False, buckets=(1, 2, 4, 8))
    bucket = graphs.bucket_for(num_seqs)
    assert bucket == {1: 1, 3: 4, 5: 8}[num_seqs]
    assert graphs.accepts([1] * num_seqs, [len(c.block_table) for c in chunks], True)
    # Poison block 0 (what padding rows read) and an unused block: neither may change, and
    # the padding rows' garbage must not reach the real rows.
    padded.kv_cache[:, :, 0] = 1e3
    plain.kv_cache[:, :, 0] = 1e3
    before = padded.kv_cache.clone()
    want = plain.execute(chunks)
    got = graphs.run(padded.prepare(chunks))
    assert got.shape == want.shape == (num_seqs, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded.kv_cache, plain.kv_cache, rtol=0, atol=1e-6)  # GEMM row blocking
    changed = (padded.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # per block
    written = {c.block_table[c.start_pos // 4] for c in chunks}
    assert set(torch.nonzero(changed).flatten().tolist()) == written


def test_buckets_reuse_buffers_and_reset_padding_after_a_larger_step(model):
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    plain, chunks = prefilled(model, prompts)
    padded, _ = prefilled(model, prompts)
    graphs = DecodeGraphRunner(model, padded.kv_cache, capture=False, buckets=(2, 4))
    big = graphs.run(padded.prepare(chunks[:3]))  # bucket 4, one padding row
    small = graphs.run(padded.prepare(chunks[3:]))  # bucket 2, row 1 must be padding again
    torch.testing.assert_close(big, plain.execute(chunks[:3]), rtol=0, atol=1e-5)
    torch.testing.assert_close(small, plain.execute(chunks[3:]), rtol=0, atol=1e-5)
    static = graphs._buffers(2)
    assert static.slot_mapping[1] == -1 and static.seq_lens[1] == 1 and graphs.replays == 2
    torch.testing.assert_close(padded.kv_cache, plain.kv_cache, rtol=0, atol=1e-6)  # GEMM row blocking


def test_what_runs_eagerly(model):
    graphs = DecodeGraphRunner(model, torch.zeros(2, 2, 8, 4, 2, 16), capture=False, buckets=(1, 2, 4))
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(5) is None
    assert not graphs.accepts([1] * 5, [1] * 5, True)  # past the largest bucket
    assert not graphs.accepts([1, 2], [1, 1], True)  # a prompt chunk
    assert not graphs.accepts([1, 1], [1, 1], False)  # a sequence that does not sample
    assert not graphs.accepts([1], [graphs.max_blocks + 1], True)  # wider than the buffers
    assert graphs.accepts([1, 1, 1], [2, 1, 3], True)
    with pytest.raises(ValueError, match="increasing"):
        DecodeGraphRunner(model, torch.zeros(2, 2, 8, 4, 2, 16), capture=False, buckets=(4, 2))
    with pytest.raises(ValueError, match="CUDA graph capture needs"):
        DecodeGraphRunner(model, torch.zeros(2, 2, 8, 4, 2, 16), capture=True)


def test_cpu_runner_never_uses_graphs(model):
    runner = ModelRunner(model, CacheConfig(block_size=4, num_blocks=8), cuda_graphs=True)
    assert runner.graphs is None and runner.kv_cache.device.type == "cpu"


def test_runner_routes_only_pure_decode_steps_to_the_graphs(model):
    """ModelRunner.execute's routing, with an eager graph runner standing in for CUDA's."""
    prompts = [[21, 22, 23], [24, 25, 26, 27, 28]]
    plain, chunks = prefilled(model, prompts)
    routed, _ = prefilled(model, prompts)
    routed.graphs = DecodeGraphRunner(model, routed.kv_cache, capture=False, buckets=(1, 4))
    torch.testing.assert_close(routed.execute(chunks), plain.execute(chunks), rtol=0, atol=1e-5)
    assert routed.graphs.replays == 1
    # A prompt chunk, a step that wants prompt logits, a per-layer callback: eager.
    prompt = [SequenceChunk([30, 31], 0, [9], True)]
    with_prompt_logits = [SequenceChunk([40, 41], 0, [10], True, prompt_logits=range(1))]
    torch.testing.assert_close(routed.execute(prompt), plain.execute(prompt), rtol=0, atol=1e-5)
    assert routed.execute(with_prompt_logits).shape[0] == 2
    step = [SequenceChunk([3], 4, chunks[0].block_table, True, is_decode=True),
            SequenceChunk([4], 6, chunks[1].block_table, True, is_decode=True)]
    layers = []
    routed.execute(step[:1], on_layer_done=layers.append)
    assert layers == [0, 1] and routed.graphs.replays == 1
    # Weights reloaded (keep_alive): a new model object, so new graphs for it.
    old = routed.graphs
    routed.model = object.__new__(type(model))
    routed.model.__dict__.update(model.__dict__)  # the same weights, another object
    routed.execute(step[1:])
    assert routed.graphs is not old and routed.graphs.model is routed.model and routed.graphs.replays == 1
    released = routed.graphs
    released.release()  # the engine unloading its weights
    assert released.model is None and not released._static
    routed.execute([SequenceChunk([5], 5, chunks[0].block_table, True, is_decode=True)])
    assert routed.graphs is not released and routed.graphs.replays == 1
