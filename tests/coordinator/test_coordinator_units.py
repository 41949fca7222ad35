"""Pure parts of the coordinator: placement, admission, text stream, timings, config."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.admission import Admission, Overloaded
from coordinator.config import CoordinatorConfig
from coordinator.convert import WorkerLoad
from coordinator.metrics import RequestTimings
from coordinator.placement import (
    Prompt, blocks_needed, choose_decode, choose_prefill, concurrency_limit, place,
)
from coordinator.registry import WorkerSnapshot
from coordinator.text_stream import TextStream
from tests.helpers.coordinator_fakes import load_model, make_tiny_model_dir


def worker(wid, role="decode", free=100, blocks=100, running=0, queued=0, budget=512,
           layout="L", backend="zmq", assigned=0, assigned_tokens=0):
    return WorkerSnapshot(wid, role, backend, layout,
                          WorkerLoad(num_blocks=blocks, num_free_blocks=free, num_running=running,
                                     queued_prefill_tokens=queued, max_num_batched_tokens=budget,
                                     block_size=16),
                          assigned, assigned_tokens)


# ---- placement (the prefix-aware scoring: tests/coordinator/test_placement.py) -------------------------------

def ids(n):
    return list(range(n))


def decode_of(ws, n):
    chosen = choose_decode(ws, Prompt(ids(n)))
    return chosen[0].worker_id if chosen else None


def prefill_of(ws, d, exclude=()):
    chosen = choose_prefill(ws, d, Prompt(ids(100)), exclude)
    return chosen[0].worker_id if chosen else None


def test_decode_choice_prefers_free_blocks_then_fewest_running():
    a, b = worker("a", free=50), worker("b", free=80)
    assert decode_of([a, b], 100) == "b"
    a, b = worker("a", free=80, running=5), worker("b", free=80, running=2)
    assert decode_of([a, b], 100) == "b"
    # Our own count wins over a stale heartbeat that still reports the worker idle.
    a, b = worker("a", free=80, running=0, assigned=6), worker("b", free=80, running=2)
    assert decode_of([a, b], 100) == "b"
    assert decode_of([worker("p", role="prefill")], 10) is None
    # No worker has room: still the one closest to fitting (its scheduler queues the request).
    assert decode_of([worker("a", free=1), worker("b", free=3)], 1000) == "b"
    assert blocks_needed(17, 16) == 2 and blocks_needed(16, 16) == 1


def test_prefill_choice_fewest_queued_tokens_and_compatible_layout():
    d = worker("d", layout="L")
    ps = [worker("p1", "prefill", queued=300), worker("p2", "prefill", queued=100),
          worker("p3", "prefill", queued=0, layout="other"),
          worker("p4", "prefill", queued=0, backend="shm")]
    assert prefill_of(ps, d) == "p2"
    assert prefill_of(ps, d, exclude={"p2"}) == "p1"
    assert prefill_of([worker("p1", "prefill", queued=100, assigned_tokens=500),
                       worker("p2", "prefill", queued=300)], d) == "p2"
    assert prefill_of(ps[2:], d) is None


@pytest.mark.parametrize("prompt,expected", [(64, None), (65, "p")])
def test_conditional_disaggregation_threshold(prompt, expected):
    ws = [worker("d"), worker("p", "prefill")]
    got = place(ws, ids(prompt), prefill_threshold=64, default_budget=512)
    assert got.decode.worker_id == "d"
    assert (got.prefill.worker_id if got.prefill else None) == expected


def test_short_prompt_goes_remote_when_decode_budget_is_full():
    busy = worker("d", running=500, budget=512)
    got = place([busy, worker("p", "prefill")], ids(20), prefill_threshold=64,
                default_budget=512)
    assert got.prefill.worker_id == "p"
    # A worker that reports no budget is judged with the configured chunk size.
    idle = worker("d", budget=0)
    got = place([idle, worker("p", "prefill")], ids(20), prefill_threshold=64,
                default_budget=16)
    assert got.prefill.worker_id == "p"


def test_colocated_and_no_prefill_worker_prefill_locally():
    got = place([worker("c", "colocated"), worker("p", "prefill")], ids(5000),
                prefill_threshold=0, default_budget=512)
    assert got.prefill is None and got.reason == "colocated worker"
    got = place([worker("d")], ids(5000), prefill_threshold=0, default_budget=512)
    assert got.prefill is None and got.reason == "no compatible prefill worker"
    got = place([worker("d"), worker("p", "prefill", layout="other")], ids(5000),
                prefill_threshold=0, default_budget=512)
    assert got.prefill is None
    assert place([worker("p", "prefill")], ids(10), prefill_threshold=0,
                 default_budget=512) is None


def test_concurrency_limit_follows_decode_workers():
    ws = [worker("a"), worker("b", blocks=3), worker("c", blocks=0), worker("p", "prefill")]
    assert concurrency_limit(ws, per_worker=8) == 8 + 3 + 8
    assert concurrency_limit([], per_worker=8) == 0


# ---- admission -----------------------------------------------------------------------------------

def test_admission_queues_then_refuses_and_frees_slots():
    async def scenario():
        limit = [1]
        adm = Admission(lambda: limit[0], max_queue=1, queue_timeout_s=5.0, retry_after_s=2)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queue_depth == 1 and not waiter.done()
        with pytest.raises(Overloaded) as info:
            await adm.acquire()
        assert info.value.retry_after_s == 2
        adm.release()
        await asyncio.wait_for(waiter, 5)
        assert adm.running == 1 and adm.queue_depth == 0
        # Capacity grows (a worker registered): wake() admits waiters at once.
        second = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        limit[0] = 2
        adm.wake()
        await asyncio.wait_for(second, 5)
        assert adm.running == 2

    asyncio.run(scenario())


def test_admission_queue_timeout_and_cancelled_waiter_leave_nothing_behind():
    async def scenario():
        adm = Admission(lambda: 1, max_queue=4, queue_timeout_s=0.05)
        await adm.acquire()
        with pytest.raises(Overloaded, match="no slot within"):
            await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queue_depth == 0 and adm.running == 1
        adm.release()
        assert adm.running == 0

    asyncio.run(scenario())


# ---- text stream and timings ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))).tokenizer


def test_text_stream_stop_string_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello world! How are you?", add_special_tokens=False)
    stream = TextStream(tokenizer, ["ld! H"])
    out, stopped = "", False
    for token in ids:
        piece, stopped = stream.push([token])
        out += piece
        if stopped:
            break
    assert stopped and out == "Hello wor" and stream.finish() == ""


def test_text_stream_without_stops_matches_full_decode(tokenizer):
    text = "Numbers 12, 345 — and “quotes”."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, [])
    out = "".join(stream.push([t])[0] for t in ids) + stream.finish()
    assert out == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_request_timings():
    t = RequestTimings(arrival=10.0)
    t.admitted = 10.5
    t.on_tokens(1, now=11.0)
    t.on_tokens(2, now=11.5)
    t.on_tokens(1, now=12.0)
    t.finished = 12.0
    assert t.queue_time == 0.5 and t.ttft == 1.0 and t.output_tokens == 4
    assert t.itl == [0.5, 0.0, 0.5]
    assert t.tpot == pytest.approx(1.0 / 3) and t.eval_time == 1.0


def test_config_validates():
    with pytest.raises(ValueError, match="max_queue"):
        CoordinatorConfig(max_queue=-1)
    for stall in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="local_prefill_max_stall_s must be >= 0"):
            CoordinatorConfig(local_prefill_max_stall_s=stall)
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        CoordinatorConfig(heartbeat_interval_s=0)
    assert CoordinatorConfig(heartbeat_interval_s=0.5, heartbeat_misses=4).heartbeat_deadline_s == 2
