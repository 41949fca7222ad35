"""The step scheduler, driven step by step with fake model outputs (no model, no torch).

Each test builds a scheduler over a small block pool, then alternates schedule() and
update_from_output() with made-up sampled tokens, asserting states, chunk sizes and block
counts after every step.
"""

from __future__ import annotations

import itertools

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from common.sampling_params import SamplingParams
from engine.scheduler import Scheduler

EOS = 0
_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 4, first_token: int = 100) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        sampling_params=SamplingParams(temperature=0),
        max_tokens=max_tokens,
        stop_token_ids=frozenset({EOS}),
    )


def make_scheduler(budget=32, num_blocks=64, block_size=4, max_seqs=8, chunk_cap=0):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          long_prefill_token_threshold=chunk_cap)
    return Scheduler(cfg, bm), bm


def step(sched: Scheduler, token: int = 7):
    """One schedule + update with `token` sampled for every request that samples."""
    out = sched.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.samples}
    finished = sched.update_from_output(out, sampled)
    return out, finished


def test_long_prompt_is_chunked_by_the_budget_and_decodes_join_first():
    sched, bm = make_scheduler(budget=16)
    a = make_request(6, max_tokens=10)
    sched.add_request(a)
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [(a.request_id, 6)]
    assert a.status is RequestStatus.RUNNING and a.num_output_tokens == 1

    b = make_request(40, max_tokens=3, first_token=300)
    sched.add_request(b)
    sizes = []
    while b.num_output_tokens == 0:
        out, _ = step(sched)
        # The running decode is always scheduled first and costs one token.
        assert out.chunks[0].request_id == a.request_id and out.chunks[0].num_tokens == 1
        assert out.num_batched_tokens <= 16
        sizes.append(out.chunks[1].num_tokens)
    assert sizes == [15, 15, 10]  # 40 prompt tokens in budget-sized chunks beside a decode
    assert b.num_computed_tokens == 40


def test_short_prompts_are_packed_into_one_pass():
    sched, _ = make_scheduler(budget=32)
    reqs = [make_request(n) for n in (5, 7, 9, 20)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    # 5 + 7 + 9 fit; the fourth gets the remaining 11 tokens as a first chunk.
    assert [c.num_tokens for c in out.chunks] == [5, 7, 9, 11]
    assert [c.samples for c in out.chunks] == [True, True, True, False]


def test_chunk_cap_limits_one_request_per_pass():
    sched, _ = make_scheduler(budget=32, chunk_cap=8)
    r = make_request(20)
    sched.add_request(r)
    assert [step(sched)[0].chunks[0].num_tokens for _ in range(3)] == [8, 8, 4]


def test_finish_on_stop_token_and_on_length_frees_blocks():
    sched, bm = make_scheduler()
    a, b = make_request(5, max_tokens=100), make_request(5, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=9)
    assert bm.num_used_blocks > 0
    _, finished = step(sched, token=9)
    assert finished == [b] and b.status is RequestStatus.FINISHED_LENGTH
    _, finished = step(sched, token=EOS)
    assert finished == [a] and a.status is RequestStatus.FINISHED_STOPPED
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_in_every_state_frees_everything():
    sched, bm = make_scheduler(budget=8, num_blocks=32)
    running = make_request(4, max_tokens=50)
    mid_prefill = make_request(30, max_tokens=50)
    queued = make_request(4, max_tokens=50)
    for r in (running, mid_prefill, queued):
        sched.add_request(r)
    step(sched)
    step(sched)
    assert running.status is RequestStatus.RUNNING
    assert 0 < mid_prefill.num_computed_tokens < 30
    assert queued.status is RequestStatus.WAITING
    for r in (queued, mid_prefill, running):
        sched.abort_request(r.request_id)
        assert r.status is RequestStatus.FINISHED_ABORTED
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.schedule().is_empty


def test_abort_during_a_pass_is_ignored_by_the_update():
    sched, bm = make_scheduler()
    r = make_request(5)
    sched.add_request(r)
    out = sched.schedule()
    sched.abort_request(r.request_id)
    assert sched.update_from_output(out, {r.request_id: 3}) == []
    assert r.num_output_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_when_the_pool_runs_out_then_recompute():
    # 6 blocks of 4 slots: two requests of 8 prompt tokens (2 blocks each) grow until the
    # pool is exhausted; the newer one is preempted, later resumes from scratch.
    sched, bm = make_scheduler(budget=32, num_blocks=6, block_size=4)
    old, new = make_request(8, max_tokens=10, first_token=100), make_request(8, max_tokens=10, first_token=200)
    sched.add_request(old)
    sched.add_request(new)
    preempted_seen = False
    for _ in range(40):
        out, _ = step(sched)
        if out.preempted:
            preempted_seen = True
            assert out.preempted == [new.request_id]
            assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
            assert all(c.request_id != new.request_id for c in out.chunks)
        bm.check_invariants()
        if not sched.has_unfinished():
            break
    assert preempted_seen
    assert old.status is RequestStatus.FINISHED_LENGTH and new.status is RequestStatus.FINISHED_LENGTH
    assert old.num_output_tokens == new.num_output_tokens == 10
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hit_skips_computed_tokens():
    sched, bm = make_scheduler(budget=64, block_size=4)
    first = make_request(18, max_tokens=1)
    sched.add_request(first)
    step(sched)
    assert first.status.is_finished
    second = make_request(18, max_tokens=1)  # same prompt tokens
    sched.add_request(second)
    out, _ = step(sched)
    # 18 tokens = 4 full blocks + 2; all 4 full blocks are reused, 2 tokens are computed.
    assert second.num_cached_tokens == 16
    assert out.chunks[0].start_pos == 16 and out.chunks[0].num_tokens == 2
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_bounds_the_running_batch():
    sched, _ = make_scheduler(budget=64, max_seqs=2)
    for _ in range(4):
        sched.add_request(make_request(3, max_tokens=5))
    out, _ = step(sched)
    assert len(out.chunks) == 2 and sched.num_waiting == 2


def test_duplicate_request_id_is_rejected():
    sched, _ = make_scheduler()
    r = make_request(3)
    sched.add_request(r)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(r)


def test_a_request_carries_its_own_chunk_cap():
    """The coordinator's chunk plan: a request may ask for smaller chunks than the worker's."""
    sched, _ = make_scheduler(budget=32, chunk_cap=16)
    planned = make_request(20, first_token=400)
    planned.max_chunk_tokens = 6
    plain = make_request(20, first_token=500)
    sched.add_request(planned)
    sched.add_request(plain)
    out, _ = step(sched)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [(planned.request_id, 6), (plain.request_id, 16)]
