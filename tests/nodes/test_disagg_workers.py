"""The prefill and decode workers in one process, joined by the in-process fake KV transport:
the disaggregated request flow step by step, its failure paths, and the KV pools after each.

The flow is the coordinator's (proto/worker.proto): both workers get the request at once with
one transfer id; the decode worker reserves blocks and grants them to the transfer, the prefill
worker computes the prompt in chunks and streams each layer's KV into them, returns the first
token (which also travels with the last layer), and the decode worker continues once all KV
and that token have landed.
"""

from __future__ import annotations

import asyncio
import logging
import contextlib
import functools
import itertools
import os
import threading
import time

import pytest
import torch

import kvtransfer
from decode_node.worker import DecodeJob, DecodeWorker, Tokens
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from common.errors import SamplingError, TandemError
from engine.kv_cache_sizing import kv_dtype_name
from engine.llm_engine import LLMEngine
from common.model_identity import model_fingerprint
from worker.node_server import kv_layout
from common.sampling_params import SamplingParams
from kvtransfer.fake import FakeFault, FakeReceiver, FakeSender
from prefill_node.senders import SenderPool
from prefill_node.worker import PrefillJob, PrefillWorker
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.sampling_faults import PoisonedSampler, unchecked

GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16
_PAIRS = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama", max_position=4096)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLMEngine:
    return LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=512)))


@pytest.fixture(scope="module")
def reference_bf16(model_dir) -> LLMEngine:
    return LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=BLOCK, num_blocks=512, kv_dtype="bf16")))


def expected(reference: LLMEngine, prompt: list[int], n: int) -> list[int]:
    return list(reference.generate(prompt, SamplingParams(temperature=0.0, num_predict=n)))


class Pair:
    """A prefill and a decode worker sharing this test's event loop."""

    def __init__(self, model_dir, loop, *, prefill_budget=32, decode_blocks=256, faults=(),
                 kv_deadline_s=30.0, ack_timeout_s=30.0, reserve_timeout_s=10.0,
                 kv_dtype="fp32", backend="fake") -> None:
        self.prefill_engine = LLMEngine.from_path(model_dir, EngineConfig(
            role="prefill",
            cache=CacheConfig(block_size=BLOCK, num_blocks=256, kv_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=prefill_budget)),
            load_tokenizer=False)
        cfg = self.prefill_engine.config.model
        # As the worker entry points build them: the prefill side from its engine's cache,
        # the decode side before allocating the cache its engine then uses.
        self.layout = kv_layout(cfg, BLOCK, kv_dtype_name(self.prefill_engine.runner.kv_cache.dtype),
                                model_fingerprint(model_dir, cfg))
        shm_name = f"tandem-test-kv-{os.getpid()}-{next(_PAIRS)}" if backend == "shm" else None
        self.cache = kvtransfer.allocate_cache(kv_layout(cfg, BLOCK, kv_dtype, self.layout.model_id),
                                               decode_blocks, shared_memory_name=shm_name)
        if backend == "fake":
            self.receiver = FakeReceiver(self.cache, self.cache.layout)
        else:
            self.receiver = kvtransfer.create_receiver(backend, self.cache, self.cache.layout)
        self.decode_engine = LLMEngine.from_path(model_dir, EngineConfig(
            role="decode",
            cache=CacheConfig(block_size=BLOCK, num_blocks=decode_blocks, kv_dtype=kv_dtype)),
            kv_cache=self.cache.tensor, load_tokenizer=False)
        self.prefill = PrefillWorker(self.prefill_engine, loop)
        self.decode = DecodeWorker(self.decode_engine, loop, self.receiver, backend, kv_deadline_s=kv_deadline_s,
                                   reserve_timeout_s=reserve_timeout_s)
        self.sender = (FakeSender(faults=faults, ack_timeout_s=ack_timeout_s) if backend == "fake"
                       else kvtransfer.create_sender(backend, ack_timeout_s=ack_timeout_s))
        self.sender.connect(self.receiver.endpoint, self.layout)
        self.prefill.start()
        self.decode.start()

    def close(self) -> None:
        self.prefill.stop()
        self.decode.stop()
        self.sender.close()
        self.receiver.close()
        self.cache.close()

    def pools_full(self) -> bool:
        return all(e.block_manager.num_free_blocks == e.block_manager.num_blocks
                   for e in (self.prefill_engine, self.decode_engine))

    async def wait_pools_full(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.pools_full() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.pools_full()

    def open(self, rid: str, prompt: list[int], max_tokens: int, params=GREEDY) -> asyncio.Queue:
        """The decode half of a disaggregated request (transfer id = request id)."""
        return self.decode.open(DecodeJob(rid, prompt, params, frozenset(), max_tokens, True,
                                          transfer_id=rid))

    async def prefill_job(self, rid: str, prompt: list[int], params=GREEDY, stops=frozenset()):
        # log_id: the client's request id, as the server passes it (log-RID here)
        return await self.prefill.prefill(PrefillJob(rid, prompt, params, rid, stop_token_ids=stops,
                                                     log_id=f"log-{rid}"), self.sender)

    async def run(self, rid: str, prompt: list[int], max_tokens: int, params=GREEDY):
        """The whole disaggregated flow, both halves at once, as the coordinator drives it;
        returns (tokens, final Tokens event). A failed prefill raises after the decode half
        ended (the sender's abort tells it)."""
        events = self.open(rid, prompt, max_tokens, params)
        try:
            outcome = await self.prefill_job(rid, prompt, params)
        except TandemError:
            final = await self.final(events)
            assert final.finish_reason == "error", final
            raise
        tokens = [outcome.first_token]
        while True:
            event = await asyncio.wait_for(events.get(), 30)
            tokens += event.token_ids
            if event.finished:
                return tokens, event

    @staticmethod
    async def final(events: asyncio.Queue) -> Tokens:
        while True:
            event = await asyncio.wait_for(events.get(), 30)
            if event.finished:
                return event


def run_async(fn):
    """Runs an async test body on a fresh event loop (the workers post results to it)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))
    return wrapper


def prompts(lengths, seed=0):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


@pytest.fixture
def pair_factory(model_dir):
    made: list[Pair] = []

    def make(**kw) -> Pair:
        pair = Pair(model_dir, asyncio.get_running_loop(), **kw)  # called inside the test's loop
        made.append(pair)
        return pair
    yield make
    for pair in made:
        pair.close()


@run_async
async def test_remote_prefill_matches_the_single_process_engine(pair_factory, reference):
    pair = pair_factory(prefill_budget=24)  # long prompts cross many chunks and block edges
    cases = prompts([3, 16, 17, 40, 100, 333])
    results = await asyncio.gather(*(pair.run(f"r{i}", p, 12) for i, p in enumerate(cases)))
    for prompt, (tokens, final) in zip(cases, results):
        assert tokens == expected(reference, prompt, 12)
        assert final.finish_reason == "length"
    assert await pair.wait_pools_full()


@run_async
async def test_bf16_kv_disaggregated_matches_the_single_process_bf16_engine(pair_factory, reference_bf16):
    pair = pair_factory(prefill_budget=24, kv_dtype="bf16")
    assert pair.layout.dtype == "bfloat16" and pair.cache.tensor.dtype == torch.bfloat16
    assert pair.decode_engine.runner.kv_cache.data_ptr() == pair.cache.tensor.data_ptr()
    cases = prompts([3, 17, 40, 150], seed=11)
    results = await asyncio.gather(*(pair.run(f"h{i}", p, 12) for i, p in enumerate(cases)))
    for prompt, (tokens, final) in zip(cases, results):
        assert tokens == expected(reference_bf16, prompt, 12)
        assert final.finish_reason == "length"
    assert pair.cache.tensor.any()  # the KV really landed in the bf16 cache
    assert await pair.wait_pools_full()


@run_async
async def test_mismatched_kv_dtype_is_refused_before_any_compute(pair_factory, model_dir):
    pair = pair_factory()  # fp32 KV on the decode side
    bf16 = LLMEngine.from_path(model_dir, EngineConfig(
        role="prefill", cache=CacheConfig(block_size=BLOCK, num_blocks=16, kv_dtype="bf16")),
        load_tokenizer=False)
    layout = kv_layout(bf16.config.model, BLOCK, kv_dtype_name(bf16.runner.kv_cache.dtype),
                       pair.layout.model_id)
    with pytest.raises(TandemError, match="dtype: 'bfloat16' != 'float32'"):
        await SenderPool(layout).get("fake", pair.receiver.endpoint)
    assert pair.prefill_engine.block_manager.num_used_blocks == 0


@run_async
async def test_local_prefill_on_the_decode_worker(pair_factory, reference):
    pair = pair_factory()
    prompt = prompts([45], seed=1)[0]
    events = pair.decode.open(DecodeJob("loc", prompt, GREEDY, frozenset(), 10, False))
    tokens = []
    while True:
        event = await asyncio.wait_for(events.get(), 30)
        tokens += event.token_ids
        if event.finished:
            break
    assert tokens == expected(reference, prompt, 10)
    assert await pair.wait_pools_full()


@run_async
async def test_corrupted_payload_fails_only_its_request(pair_factory, reference, caplog):
    pair = pair_factory(faults=[FakeFault("corrupt", transfer_id="bad", layer=1)])
    good, bad = prompts([50, 50], seed=2)
    with caplog.at_level(logging.WARNING, logger="prefill_node.connector"):
        (g_tokens, g_final), (b_tokens, b_final) = await asyncio.gather(
            pair.run("good", good, 8), pair.run("bad", bad, 8))
        # The prefill side learns the transfer failed when its engine next polls the sender,
        # which may be after the decode side's answer; it logs it before freeing the blocks.
        assert await pair.wait_pools_full()
    # Logged on the prefill engine's thread, with the request's own id (not the context's).
    (line,) = [r for r in caplog.records if r.name == "prefill_node.connector"]
    assert "KV transfer bad failed" in line.getMessage() and line.request_id == "log-bad"
    assert g_tokens == expected(reference, good, 8)
    assert b_final.finish_reason == "error" and "KV transfer failed" in b_final.error
    assert b_tokens == b_tokens[:1]  # only the prefill's first token, nothing decoded


@run_async
async def test_mismatched_layout_is_refused_before_any_compute(pair_factory):
    pair = pair_factory()
    other = kvtransfer.KVLayout(pair.layout.num_layers, pair.layout.num_kv_heads, pair.layout.head_dim,
                                BLOCK, "float32", "another-model")
    with pytest.raises(TandemError, match="does not match"):
        await SenderPool(other).get("fake", pair.receiver.endpoint)
    assert pair.prefill_engine.block_manager.num_used_blocks == 0


@run_async
async def test_abort_mid_decode_frees_both_pools(pair_factory):
    pair = pair_factory()
    prompt = prompts([30], seed=3)[0]
    events = pair.open("d", prompt, 1000)
    await pair.prefill_job("d", prompt)
    got = 0
    while got < 5:
        got += len((await asyncio.wait_for(events.get(), 10)).token_ids)
    assert pair.decode_engine.block_manager.num_used_blocks > 0
    pair.decode.close_stream("d")
    assert await pair.wait_pools_full()


@run_async
async def test_abort_mid_prefill_frees_both_pools(pair_factory):
    pair = pair_factory(prefill_budget=8)
    prompt = prompts([2000], seed=4)[0]  # 250 chunks of 8 tokens: long enough to catch mid-way
    events = pair.open("p", prompt, 10)
    task = asyncio.create_task(pair.prefill_job("p", prompt))
    deadline = time.monotonic() + 10
    while pair.prefill_engine.block_manager.num_used_blocks < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    request = pair.prefill_engine.scheduler.requests.get("p")
    assert request is not None and 0 < request.num_computed_tokens < 2000
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The sender's abort reaches the decode worker: its half ends by itself, with the reason.
    final = await pair.final(events)
    assert final.finish_reason == "error" and "KV transfer failed" in final.error
    assert await pair.wait_pools_full()


@run_async
async def test_abort_while_kv_is_landing_frees_once_released(pair_factory):
    pair = pair_factory(faults=[FakeFault("slow", delay_s=0.05)], ack_timeout_s=5)
    prompt = prompts([64], seed=5)[0]
    events = pair.open("t", prompt, 10)
    await pair.prefill_job("t", prompt)  # returns at once; 2 layers x 0.05 s still to land
    request = pair.decode_engine.scheduler.requests["t"]
    assert request.kv_state.value == "receiving"
    pair.decode.close_stream("t")
    assert await pair.wait_pools_full()
    assert request.kv_state.value == "released"


@run_async
async def test_kv_that_never_arrives_fails_at_the_deadline(pair_factory):
    pair = pair_factory(faults=[FakeFault("drop")], kv_deadline_s=0.5, ack_timeout_s=0.5)
    tokens, final = await pair.run("lost", prompts([40], seed=6)[0], 10)
    assert final.finish_reason == "error" and "KV transfer failed" in final.error
    assert await pair.wait_pools_full()


@run_async
async def test_prompt_larger_than_the_decode_pool_is_refused_at_once(pair_factory):
    pair = pair_factory(decode_blocks=4)  # 64 slots: the context this worker can hold
    event = await asyncio.wait_for(pair.open("big", prompts([100], seed=7)[0], 10).get(), 10)
    assert isinstance(event, Tokens) and event.finish_reason == "error" and "context window of 64" in event.error
    assert pair.pools_full()


@run_async
async def test_reservation_waits_for_blocks_then_proceeds_or_times_out(pair_factory, reference):
    pair = pair_factory(decode_blocks=8, reserve_timeout_s=3.0)  # 128 slots
    first, second = prompts([100, 100], seed=9)
    sched = pair.decode_engine.scheduler
    events_a = pair.open("a", first, 4)
    await wait_for_state(lambda: "a" in sched.waiting_for_kv)
    events_b = pair.open("b", second, 4)
    await asyncio.sleep(0.1)
    # b waits, in arrival order, for blocks: the pool cannot hold both prompts
    assert events_b.empty() and [r.request_id for r in sched.waiting] == ["b"]
    pair.decode.close_stream("a")  # a's blocks come back once released ...
    await wait_for_state(lambda: "b" in sched.waiting_for_kv)  # ... and b's reservation goes through
    events_c = pair.open("c", first, 4)
    timed_out = await asyncio.wait_for(events_c.get(), 10)
    assert timed_out.finish_reason == "error" and "no free KV blocks for" in timed_out.error
    pair.decode.close_stream("b")
    assert await pair.wait_pools_full()
    assert events_a.empty()


async def wait_for_state(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@run_async
async def test_seeded_sampling_is_the_same_disaggregated(pair_factory, reference):
    """Each seeded draw depends on (seed, position) only, so the prefill worker's first token
    and the decode worker's next ones equal the single-process engine's."""
    pair = pair_factory()
    seeded = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=4242)
    prompt = prompts([37], seed=8)[0]
    alone = list(reference.generate(prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=4242,
                                                            num_predict=16)))
    tokens, _ = await pair.run("seeded", prompt, 16, seeded)
    assert tokens == alone


@run_async
async def test_a_dead_engine_fails_open_requests_and_refuses_new_ones(pair_factory):
    pair = pair_factory()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel fault")
    pair.decode_engine.runner.execute = broken  # the fault lives in the model, not in a hook
    events = pair.decode.open(DecodeJob("x", prompts([20], seed=10)[0], GREEDY, frozenset(), 5, False))
    final = await asyncio.wait_for(events.get(), 10)
    assert final.finished and final.finish_reason == "error" and "simulated kernel fault" in final.error
    assert not pair.decode.alive
    with pytest.raises(RuntimeError, match="not running"):
        pair.decode.open(DecodeJob("y", [5, 6], GREEDY, frozenset(), 5, False))


@run_async
async def test_a_sampling_failure_fails_only_its_request_on_either_worker(pair_factory, reference):
    """Values the APIs refuse (here temperature 1e308, inf in fp32) reach the workers'
    sampler only through a direct call; the request ends with an error, its blocks are freed,
    the other requests finish, and both engine loops keep running."""
    pair = pair_factory()
    good, bad, local, late = prompts([40, 30, 20, 25], seed=12)
    hot = unchecked(temperature=1e308)
    results = await asyncio.gather(pair.run("good", good, 8), pair.run("bad", bad, 8, hot),
                                   return_exceptions=True)
    assert results[0][0] == expected(reference, good, 8)
    assert isinstance(results[1], SamplingError) and "sampling failed" in str(results[1])

    events = pair.decode.open(DecodeJob("local", local, hot, frozenset(), 8, False))
    final = await asyncio.wait_for(events.get(), 10)
    assert final.finished and final.finish_reason == "error" and "sampling failed" in final.error

    # Mid-decode on the decode worker: the prefill's first token is fine, the third is not.
    poisoned = SamplingParams(temperature=0.0)
    pair.decode_engine.sampler = PoisonedSampler(poisoned, len(late), after=3)
    tokens, final = await pair.run("late", late, 8, poisoned)
    assert tokens == expected(reference, late, 3)
    assert final.finish_reason == "error" and "sampling failed" in final.error

    assert pair.prefill.alive and pair.decode.alive
    assert await pair.wait_pools_full()
    tokens, final = await pair.run("after", good, 8)
    assert tokens == expected(reference, good, 8) and final.finish_reason == "length"
    assert await pair.wait_pools_full()


@run_async
async def test_kv_transfer_overlaps_the_prefill_compute(pair_factory, reference):
    """With every KV unit slowed on the sender's I/O thread, layer i's KV moves while later
    layers and chunks compute: units arrive between the first and the last layer's compute,
    and the whole prefill-to-decode time stays below compute plus transfer."""
    # Per unit about what a 32-token chunk's layer costs to compute here, so neither side
    # dwarfs the other and the overlap (or its absence) shows in the total.
    delay = 0.0007
    pair = pair_factory(prefill_budget=32, faults=[FakeFault("slow", delay_s=delay)])
    computed: list[float] = []  # after each layer of each pass, on the engine thread
    arrived: list[float] = []  # each unit written into the decode cache
    bind = pair.prefill.connector.bind_pass

    def timed_bind(plan):
        save = bind(plan)
        if save is None:
            return None

        def timed(layer: int) -> None:
            save(layer)
            computed.append(time.monotonic())
        return timed
    pair.prefill.connector.bind_pass = timed_bind
    ingest = pair.receiver.table.ingest

    def timed_ingest(*args, **kwargs):
        ack = ingest(*args, **kwargs)
        arrived.append(time.monotonic())
        return ack
    pair.receiver.table.ingest = timed_ingest

    prompt = prompts([2400], seed=13)[0]  # 75 chunks of 32 tokens
    start = time.monotonic()
    tokens, final = await pair.run("o", prompt, 2)
    admitted = time.monotonic()
    assert tokens == expected(reference, prompt, 2)
    units = len(computed)
    assert len(arrived) >= units - 1  # every chunk's layers (the last may carry the rest)
    compute = computed[-1] - start
    # The transfer's own duration: the units are serial on the sender's thread, each at least
    # its sleep; a design that sent only after the compute would take compute + transfer.
    transfer = max(len(arrived) * delay, arrived[-1] - arrived[0])
    # Units land while later layers and chunks still compute (a serial design would deliver
    # none before computed[-1]) ...
    during = [t for t in arrived if computed[0] < t < computed[-1]]
    assert len(during) >= 2, (len(during), len(arrived), compute)
    # ... so the transfer's time hides under the compute's instead of adding to it.
    assert admitted - start < compute + transfer, (admitted - start, compute, transfer)
    assert await pair.wait_pools_full()


@run_async
async def test_shm_cancel_mid_prefill_never_lets_a_late_write_hit_a_reused_block(pair_factory, reference):
    """The reuse race, made deterministic: the shm sender is held between its owner-table check
    and its memcpy; the request is cancelled on both workers, and a flood of local requests
    that need the whole pool arrives at once. The cancelled request's blocks are not reused
    until the sender acknowledges the revocation (it can, only after its held write lands), so
    every flood answer equals the single-process one and both pools end full. Without the
    acknowledgement the late write would land in a flood request's block."""
    pair = pair_factory(backend="shm", prefill_budget=16, decode_blocks=14)  # 224 slots
    held, release = threading.Event(), threading.Event()
    seen = []

    def hook(header) -> None:
        seen.append(header)
        if len(seen) == 5:  # mid-prefill: chunk 3's first layer
            held.set()
            release.wait(10)
    pair.sender.pre_write_hook = hook
    long_prompt = prompts([200], seed=14)[0]  # 13 blocks of the decode pool's 14
    events = pair.open("victim", long_prompt, 10)
    prefill = asyncio.create_task(pair.prefill_job("victim", long_prompt))
    assert await asyncio.to_thread(held.wait, 10)
    pair.decode.close_stream("victim")
    prefill.cancel()
    flood = prompts([60, 60, 60], seed=15)  # 4 blocks each at least: they need victim's blocks
    streams = [pair.decode.open(DecodeJob(f"f{i}", p, GREEDY, frozenset(), 6, False))
               for i, p in enumerate(flood)]
    await asyncio.sleep(0.3)
    victim_blocks = pair.decode_engine.block_manager.num_used_blocks
    assert victim_blocks >= 13  # still held: a writer may remain
    assert all(q.empty() for q in streams)
    release.set()  # the held write lands in victim's (still unreleased) blocks; then the ack
    results = []
    for q in streams:
        tokens = []
        while True:
            event = await asyncio.wait_for(q.get(), 30)
            tokens += event.token_ids
            if event.finished:
                break
        results.append(tokens)
    for prompt, tokens in zip(flood, results):
        assert tokens == expected(reference, prompt, 6)
    # The hook holds the sender's I/O thread, not the engine: on a fast pass the prefill may
    # have computed its last chunk (and returned its first token) before the cancel arrived.
    # Either way the held write is the late one the revocation must wait for.
    with contextlib.suppress(asyncio.CancelledError):
        await prefill
    assert events.empty() or (await events.get()).finished
    assert await pair.wait_pools_full()


@run_async
async def test_the_prefill_workers_first_token_obeys_logit_bias_and_min_tokens(pair_factory, reference):
    """The prefill worker samples the first token: logit_bias and min_tokens' stop mask
    (the stop set travels in PrefillRequest.stop_token_ids) apply to it too."""
    pair = pair_factory()
    prompt = prompts([20], seed=3)[0]
    first = expected(reference, prompt, 1)[0]
    other = (first + 1) % 320

    async def first_token(rid, params, stops=frozenset()):
        events = pair.open(rid, prompt, 2, params)
        outcome = await pair.prefill_job(rid, prompt, params, stops)
        await pair.final(events)
        return outcome.first_token

    def greedy(**kw):
        return SamplingParams(temperature=0.0, **kw)

    assert await first_token("plain", greedy(), frozenset({first})) == first
    assert await first_token("up", greedy(logit_bias={other: 100})) == other
    assert await first_token("down", greedy(logit_bias={first: -100})) != first
    assert await first_token("min", greedy(min_tokens=1), frozenset({first})) != first
    assert await pair.wait_pools_full()
