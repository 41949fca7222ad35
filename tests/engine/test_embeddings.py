"""Embeddings on the decode worker (engine/embedding.py, DecodeWorker.embed): the pooled vector
against the single-process engine's forward pass, batching across passes, and the KV pool
after each call (every temporary block freed, no prefix registered)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_node.worker import DecodeJob, DecodeWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.embedding import plan_batches
from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk
from common.sampling_params import SamplingParams
from reliability.model_factory import make_tiny_hf_model

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


@pytest.fixture(scope="module")
def reference(model_dir) -> LLMEngine:
    return LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=64)), load_tokenizer=False)


def reference_vector(engine: LLMEngine, ids: list[int], normalize: bool = True) -> torch.Tensor:
    """The final normed hidden states of one prompt from the model's own forward pass, in a
    KV cache of its own, mean-pooled and L2-normalized here."""
    blocks = list(range(-(-len(ids) // BLOCK)))
    batch = engine.runner.prepare([SequenceChunk(ids, 0, blocks, needs_logits=False, is_decode=False)])
    kv = torch.zeros_like(engine.runner.kv_cache)
    with torch.inference_mode():
        hidden = engine.model.forward(batch, kv).double()
    v = hidden.mean(dim=0)
    return v / v.norm() if normalize else v


def run(fn):
    async def main():
        return await fn(asyncio.get_running_loop())
    return asyncio.run(main())


def check_pool(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.owners() == []
    assert bm.cached_hashes() == []


def test_plan_batches_keeps_order_and_budget():
    assert plan_batches([3, 4, 2, 9, 1], 7) == [[0, 1], [2], [3], [4]]
    assert plan_batches([10], 4) == [[0]]


def test_embed_matches_the_engine_forward_pass_and_frees_every_block(model_dir, reference):
    # A budget of 40 tokens: the three inputs take two passes, with a decode running beside them.
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=40)), load_tokenizer=False)
    inputs = [[5, 17, 3, 99, 42, 7, 8, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
              [9, 8, 7],
              list(range(30, 65))]

    async def body(loop):
        worker = DecodeWorker(engine, loop)
        worker.start()
        try:
            stream = worker.open(DecodeJob("gen", [1, 2, 3, 4], SamplingParams(temperature=0.0),
                                           frozenset(), 8, remote_prefill=False))
            vectors = await asyncio.wait_for(worker.embed(inputs), 60)
            raw = await asyncio.wait_for(worker.embed(inputs[1:2], normalize=False), 60)
            while not (await asyncio.wait_for(stream.get(), 60)).finished:
                pass
            await asyncio.sleep(0.05)
            return vectors, raw, engine.block_manager
        finally:
            worker.stop()

    vectors, raw, _ = run(body)
    assert len(vectors) == len(inputs)
    for ids, v in zip(inputs, vectors):
        got = torch.tensor(v, dtype=torch.float64)
        assert got.shape == (engine.config.model.hidden_size,)
        assert abs(got.norm().item() - 1.0) < 1e-5
        torch.testing.assert_close(got, reference_vector(reference, ids), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(raw[0], dtype=torch.float64),
                               reference_vector(reference, inputs[1], normalize=False),
                               atol=1e-4, rtol=1e-4)
    # The decode request finished and freed its blocks too; the embeddings kept none.
    engine.block_manager.reset_prefix_cache()  # the generate request registered its prefix
    check_pool(engine)


def test_embed_refuses_empty_and_overlong_inputs(model_dir):
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        max_model_len=32), load_tokenizer=False)

    async def body(loop):
        worker = DecodeWorker(engine, loop)
        worker.start()
        try:
            for bad in ([[]], [list(range(33))]):
                with pytest.raises(ValueError):
                    await worker.embed(bad)
        finally:
            worker.stop()

    run(body)
    check_pool(engine)
