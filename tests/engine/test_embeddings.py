"""Embeddings on the decode worker (engine/embedding.py, DecodeWorker.embed): the pooled vector
against the single-process engine's forward pass, batching across passes, and the KV pool
after each call (every temporary block freed, no prefix registered)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_node.worker import DecodeJob, DecodeWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk
from common.pooling import Pooling
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


def reference_vector(engine: LLMEngine, ids: list[int], normalize: bool = True,
                     pooling: Pooling = Pooling.MEAN) -> torch.Tensor:
    """The final normed hidden states of one prompt from the model's own forward pass, in a
    KV cache of its own, pooled (their mean, or the last one) and L2-normalized here."""
    blocks = list(range(-(-len(ids) // BLOCK)))
    batch = engine.runner.prepare([SequenceChunk(ids, 0, blocks, needs_logits=False, is_decode=False)])
    kv = torch.zeros_like(engine.runner.kv_cache)
    with torch.inference_mode():
        hidden = engine.model.forward(batch, kv).double()
    v = hidden[-1] if pooling is Pooling.LAST else hidden.mean(dim=0)
    return v / v.norm() if normalize else v


def run(fn):
    async def main():
        return await fn(asyncio.get_running_loop())
    return asyncio.run(main())


def record_plans(engine: LLMEngine) -> list:
    """Every SchedulerOutput the engine's scheduler hands out from now on, in order."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    return plans


def check_pool(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.owners() == []
    assert bm.cached_hashes() == []


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
            last = await asyncio.wait_for(worker.embed(inputs, pooling=Pooling.LAST), 60)
            while not (await asyncio.wait_for(stream.get(), 60)).finished:
                pass
            await asyncio.sleep(0.05)
            return vectors, raw, last
        finally:
            worker.stop()

    vectors, raw, last = run(body)
    assert len(vectors) == len(inputs)
    for ids, v in zip(inputs, vectors):
        got = torch.tensor(v, dtype=torch.float64)
        assert got.shape == (engine.config.model.hidden_size,)
        assert abs(got.norm().item() - 1.0) < 1e-5
        torch.testing.assert_close(got, reference_vector(reference, ids), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(raw[0], dtype=torch.float64),
                               reference_vector(reference, inputs[1], normalize=False),
                               atol=1e-4, rtol=1e-4)
    # Last-token pooling: the last position's state, which differs from the mean.
    for ids, v in zip(inputs, last):
        want = reference_vector(reference, ids, pooling=Pooling.LAST)
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64), want, atol=1e-4, rtol=1e-4)
        assert (want - reference_vector(reference, ids)).abs().max() > 1e-2
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


@pytest.mark.parametrize("pooling", list(Pooling))
def test_a_long_input_is_chunked_beside_a_running_decode(model_dir, reference, pooling):
    """Budget 16: a 70-token input takes five passes, and every one of them also carries the
    running request's decode token (split-fuse); the vector equals the unchunked one (for last
    pooling: the last pass's last position, not an earlier pass's)."""
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=16)), load_tokenizer=False)
    gen = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0), "gen", max_tokens=40)
    engine.step()  # the prompt; "gen" decodes from here on
    ids = [(7 * i + 3) % 250 for i in range(70)]
    engine.submit(engine.make_embedding_request(ids, request_id="emb", pooling=pooling))
    passes, vector = [], None
    while vector is None:
        outs = engine.step()
        passes.append([o.request_id for o in outs])
        vector = next((o.embedding for o in outs if o.request_id == "emb"), None)
        assert len(passes) < 20
    assert len(passes) == 5  # ceil(70 / 15): 15 embedding tokens + 1 decode token per pass
    assert all("gen" in p for p in passes)  # the stream got a token in every pass
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64),
                               reference_vector(reference, ids, pooling=pooling),
                               atol=1e-4, rtol=1e-4)
    assert "emb" not in engine.scheduler.requests
    engine.abort_request(gen.request_id)
    engine.block_manager.reset_prefix_cache()
    check_pool(engine)


@pytest.mark.parametrize("pooling", list(Pooling))
def test_a_preempted_input_is_pooled_from_its_recompute(model_dir, reference, pooling):
    """A pool too small for both: the embedding is preempted by the older decode's growth and
    recomputed from its first token; its vector still equals the reference."""
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=6),
        scheduler=SchedulerConfig(max_num_batched_tokens=24)), load_tokenizer=False)
    engine.add_request(list(range(1, 40)), SamplingParams(temperature=0.0), "gen", max_tokens=40)
    ids = [(5 * i + 1) % 250 for i in range(50)]
    engine.submit(engine.make_embedding_request(ids, request_id="emb", pooling=pooling))
    plans = record_plans(engine)
    vector = None
    for _ in range(200):
        outs = engine.step()
        vector = vector or next((o.embedding for o in outs if o.request_id == "emb"), None)
        if not engine.has_unfinished():
            break
    assert vector is not None and any("emb" in plan.preempted for plan in plans)
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64),
                               reference_vector(reference, ids, pooling=pooling),
                               atol=1e-4, rtol=1e-4)
    engine.block_manager.reset_prefix_cache()
    check_pool(engine)


def test_a_caller_that_leaves_stops_the_work_and_frees_the_blocks(model_dir):
    """Budget 8, a 200-token input (25 passes): the caller is cancelled after the first pass;
    the request is aborted between two passes and no block stays held."""
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=8)), load_tokenizer=False)
    steps = []
    real_step = engine.step
    engine.step = lambda: steps.append(1) or real_step()

    async def body(loop):
        worker = DecodeWorker(engine, loop)
        worker.start()
        try:
            task = asyncio.ensure_future(worker.embed([[(3 * i) % 250 for i in range(200)]]))
            while len(steps) < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):
                await asyncio.sleep(0.01)
                if not engine.scheduler.requests:
                    break
        finally:
            worker.stop()

    run(body)
    assert not engine.scheduler.requests
    assert len(steps) < 25  # stopped long before the 25 passes the input needed
    engine.block_manager.reset_prefix_cache()
    check_pool(engine)


def test_the_coordinator_s_chunk_plan_caps_each_pass_of_an_input(model_dir, reference):
    """max_chunk_tokens 16 (the coordinator sends its local chunk size): a 70-token input takes
    five passes even though the budget would fit it in one; the vector is unchanged."""
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=512)), load_tokenizer=False)
    plans = record_plans(engine)
    ids = [(11 * i + 5) % 250 for i in range(70)]

    async def body(loop):
        worker = DecodeWorker(engine, loop)
        worker.start()
        try:
            return await asyncio.wait_for(worker.embed([ids], max_chunk_tokens=16), 60)
        finally:
            worker.stop()

    [vector] = run(body)
    assert [c.num_tokens for plan in plans for c in plan.chunks] == [16, 16, 16, 16, 6]
    torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64),
                               reference_vector(reference, ids), atol=1e-4, rtol=1e-4)
    check_pool(engine)


def test_a_prefill_worker_embeds_with_its_own_engine(model_dir, reference):
    """The coordinator prefers a prefill worker for embeddings: same vectors, every block freed."""
    from prefill_node.worker import PrefillWorker

    engine = LLMEngine.from_path(model_dir, EngineConfig(
        role="prefill", weight_format="fp32", cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=32)), load_tokenizer=False)
    inputs = [list(range(40, 110)), [7, 8, 9]]

    async def body(loop):
        worker = PrefillWorker(engine, loop)
        worker.start()
        try:
            return await asyncio.wait_for(worker.embedder.embed(inputs), 60)
        finally:
            worker.stop()

    for ids, v in zip(inputs, run(body)):
        torch.testing.assert_close(torch.tensor(v, dtype=torch.float64),
                                   reference_vector(reference, ids), atol=1e-4, rtol=1e-4)
    check_pool(engine)
