"""Worker failures in the simulator: requests move as the coordinator moves them (prompt plus
the tokens so far, on the live workers), against closed forms; nothing is lost while a worker
of each role lives; what cannot move is counted as lost, never in the percentiles."""

from __future__ import annotations

import random

import pytest

from planner.cost_profile import CostProfile
from planner.metrics import SLO
from planner.search import SearchSpace, search
from planner.simulator import ClusterConfig, WorkerFailure, simulate
from planner.trace import LengthDist, Request, generate


def prefill_s(p: CostProfile, tokens: int) -> float:
    return p.prefill_pass_s(tokens, CostProfile.chunk_pairs(tokens, 0))


def steps_s(p: CostProfile, context: int, steps: int) -> float:
    """`steps` decode steps of one sequence alone, its context growing from `context`."""
    return sum(p.decode_step_s(1, context + k) for k in range(steps))


def test_a_failure_after_the_load_changes_nothing(profile):
    trace = generate(20, 200, LengthDist("uniform", low=16, high=600), LengthDist("uniform", low=1, high=40), seed=3)
    plain = simulate(trace, profile, ClusterConfig(2, 2))
    late = simulate(trace, profile, ClusterConfig(2, 2, failures=(WorkerFailure("decode", 0, 1e6),)))
    assert [(t.first_token_s, t.finish_s) for t in late.times] == [(t.first_token_s, t.finish_s) for t in plain.times]
    assert late.summary.migrations == late.summary.failed == 0


def test_a_decode_death_moves_the_request_with_its_tokens(profile):
    """One request on decode 0, which dies mid-decode after k steps: it is prefilled again with
    prompt + 1 + k tokens and ends its output on decode 1; TTFT is the first token's."""
    p, prompt, output = profile, 300, 20
    first = p.coordinator_overhead_s + prefill_s(p, prompt)
    landed = first + p.transfer_latency_s  # the KV streams faster than the pass computes
    k = 6
    die = landed + steps_s(p, prompt + 1, k) + 0.5 * p.decode_step_s(1, prompt + 1 + k)  # mid step k + 1
    res = simulate([Request(0.0, prompt, output)], p,
                   ClusterConfig(1, 2, failures=(WorkerFailure("decode", 0, die),)))
    r = res.times[0]
    assert r.first_token_s == pytest.approx(first)
    now = prompt + 1 + k  # the step in progress at the death is lost
    token = die + prefill_s(p, now)
    landed2 = max(token, die + now * p.kv_bytes_per_token / p.transfer_bytes_per_s) + p.transfer_latency_s
    assert r.finish_s == pytest.approx(landed2 + steps_s(p, now + 1, output - (1 + k) - 1))
    assert res.summary.migrations == 1 and res.summary.failed == 0
    # Its gaps: k before the death, one across it (to the re-prefill's token), the rest after.
    assert sum(n for _, n in res.itl) == output - 1
    assert sum(v * n for v, n in res.itl) == pytest.approx(r.finish_s - r.first_token_s)
    across = landed + steps_s(p, prompt + 1, k)
    assert any(v == pytest.approx(token - across) and n == 1 for v, n in res.itl)


def test_a_pass_for_a_request_that_moved_runs_on_as_waste(profile):
    """A 2,000-token prompt in 512-token passes; its decode worker dies during the second pass.
    That pass completes (the prefill worker does not know yet), then the prompt is prefilled
    again from the start for the other decode worker: 2 + 4 passes."""
    p = profile
    chunks = [(512, 0), (512, 512), (512, 1024), (464, 1536)]
    cost = [p.prefill_pass_s(n, CostProfile.chunk_pairs(n, ctx)) for n, ctx in chunks]
    die = p.coordinator_overhead_s + cost[0] + 0.5 * cost[1]
    res = simulate([Request(0.0, 2000, 4)], p,
                   ClusterConfig(1, 2, token_budget=512, failures=(WorkerFailure("decode", 0, die),)))
    assert res.prefill_passes == 6 and res.summary.migrations == 1
    restart = p.coordinator_overhead_s + cost[0] + cost[1]
    assert res.times[0].first_token_s == pytest.approx(restart + sum(cost))


def test_a_prefill_death_waits_for_its_restart_and_loses_nothing(profile):
    """The only prefill worker dies in the second pass of a 2,000-token prompt and is back 1 s
    later: that prompt starts over then, and a request arriving meanwhile waits for it too."""
    p, die, back = profile, 0.1, 1.0
    trace = [Request(0.0, 2000, 5), Request(0.5, 100, 5)]
    res = simulate(trace, p, ClusterConfig(1, 1, token_budget=512,
                                           failures=(WorkerFailure("prefill", 0, die, back),)))
    assert res.summary.requests == 2 and res.summary.failed == 0 and res.summary.migrations == 1
    # The second arrived during the outage, behind the moved one (moves go first): 48 of its
    # tokens are packed into the moved prompt's last pass (464 + 48), the rest into the next.
    first3 = sum(p.prefill_pass_s(512, CostProfile.chunk_pairs(512, ctx)) for ctx in (0, 512, 1024))
    last = p.prefill_pass_s(512, CostProfile.chunk_pairs(464, 1536) + CostProfile.chunk_pairs(48, 0))
    assert res.times[0].first_token_s == pytest.approx(die + back + first3 + last)
    rest = p.prefill_pass_s(52, CostProfile.chunk_pairs(52, 48))
    assert res.times[1].first_token_s == pytest.approx(die + back + first3 + last + rest)


def test_with_no_worker_of_a_role_left_requests_are_lost_not_measured(profile):
    trace = generate(10, 60, LengthDist("uniform", low=100, high=400), LengthDist("uniform", low=2, high=20), seed=4)
    slo = SLO(60.0, 60.0)
    alone = simulate(trace, profile, ClusterConfig(1, 1, failures=(WorkerFailure("prefill", 0, 2.0),)), slo)
    s = alone.summary
    assert s.failed > 0 and s.requests + s.failed == len(trace) and not s.meets(slo)
    assert all(t.first_token_s < 2.0 + 1e-9 or t.arrival_s < 2.0 for t in alone.times)
    spare = simulate(trace, profile, ClusterConfig(2, 1, failures=(WorkerFailure("prefill", 0, 2.0),)), slo)
    assert spare.summary.failed == 0 and spare.summary.requests == len(trace) and spare.summary.meets(slo)


@pytest.mark.parametrize("max_migrations, lost", [(1, 1), (2, 0)])
def test_a_request_moves_at_most_max_migrations_times(profile, max_migrations, lost):
    """Decode 0 dies, the request moves to decode 1 (the least loaded, first by index), which
    dies too: a third placement is over a cap of 1 move."""
    p, prompt = profile, 200
    landed = p.coordinator_overhead_s + prefill_s(p, prompt) + p.transfer_latency_s
    die = [landed + 2.5 * p.decode_step_s(1, prompt + 1), 1.0]
    config = ClusterConfig(1, 3, max_migrations=max_migrations,
                           failures=(WorkerFailure("decode", 0, die[0]), WorkerFailure("decode", 1, die[1])))
    if lost:
        alone = simulate([Request(0.0, prompt, 200)], p, config, SLO(60.0, 60.0)).summary
        assert alone.failed == 1 and alone.requests == 0 and alone.migrations == 1
        assert alone.ttft_p99_s != alone.ttft_p99_s and not alone.meets(SLO(60.0, 60.0))  # nan: none finished
        res = simulate([Request(0.0, prompt, 200), Request(5.0, 50, 3)], p, config)
        assert res.summary.failed == 1 and res.summary.requests == 1
    else:
        res = simulate([Request(0.0, prompt, 200)], p, config)
        assert res.summary.failed == 0 and res.summary.migrations == 2


def test_every_token_gap_is_counted_once_through_failures_and_restarts(profile):
    rng = random.Random(11)
    trace = sorted((Request(rng.uniform(0, 5), rng.randint(10, 600), rng.randint(1, 80)) for _ in range(300)),
                   key=lambda r: r.arrival_s)
    failures = (WorkerFailure("decode", 0, 1.0, 0.5), WorkerFailure("prefill", 1, 2.0, 1.0),
                WorkerFailure("decode", 2, 3.0), WorkerFailure("decode", 1, 3.5, 0.2))
    for host_cores in (0.0, 2.0):
        # (Some requests meet three of the deaths: a cap of 10 moves loses none.)
        res = simulate(trace, profile, ClusterConfig(2, 3, max_batch=8, host_cores=host_cores, failures=failures,
                                                     max_migrations=10))
        assert res.summary.failed == 0 and res.summary.requests == len(trace) and res.summary.migrations > 0
        assert sum(n for _, n in res.itl) == sum(t.output_tokens - 1 for t in res.times)
        assert sum(v * n for v, n in res.itl) == pytest.approx(sum(t.finish_s - t.first_token_s for t in res.times))
        assert all(v >= 0 for v, _ in res.itl)
        assert all(t.finish_s >= t.first_token_s >= t.arrival_s for t in res.times)


def test_a_move_with_no_live_decode_worker_is_lost_at_once(profile):
    """The coordinator has nowhere to place it (it ends the request with an error), even if the
    worker comes back later; a request arriving during the outage waits for it."""
    p = profile
    landed = p.coordinator_overhead_s + prefill_s(p, 100) + p.transfer_latency_s
    config = ClusterConfig(1, 1, failures=(WorkerFailure("decode", 0, landed + 0.05, 1.0),))
    res = simulate([Request(0.0, 100, 50), Request(0.5, 100, 5)], p, config)
    assert res.summary.failed == 1 and res.summary.migrations == 0 and res.summary.requests == 1
    assert res.times[0].arrival_s == 0.5 and res.times[0].first_token_s >= landed + 0.05 + 1.0


def test_a_candidate_that_loses_everything_is_a_candidate_that_does_not_meet(profile):
    trace = generate(15, 100, LengthDist("uniform", low=32, high=400), LengthDist("uniform", low=2, high=30), seed=2)
    space = SearchSpace(token_budgets=(512,), max_batches=(32,), max_workers=20,
                        failures=(WorkerFailure("prefill", 0, 0.0),))
    plan = search(trace, profile, SLO(2.0, 0.2), space)
    lost_all = [c for c in plan.tried if c.config.prefill_workers == 1]
    assert lost_all and all(c.summary.failed == len(trace) and not c.meets for c in lost_all)
    assert plan.best is not None and plan.best.config.prefill_workers == 2


def test_the_search_keeps_decode_workers_to_spare_beyond_the_ones_that_die(profile):
    trace = generate(10, 100, LengthDist("uniform", low=32, high=400), LengthDist("uniform", low=2, high=30), seed=5)
    deaths = tuple(WorkerFailure("decode", i, 2.0) for i in range(3))
    plan = search(trace, profile, SLO(2.0, 0.2),
                  SearchSpace(token_budgets=(512,), max_batches=(32,), max_workers=12, failures=deaths))
    assert plan.best is not None and plan.best.config.decode_workers >= 4 and plan.best.summary.failed == 0


def test_failures_parse_and_are_validated():
    assert WorkerFailure.parse("decode:0@30") == WorkerFailure("decode", 0, 30.0, None)
    assert WorkerFailure.parse("prefill:1@12.5+20") == WorkerFailure("prefill", 1, 12.5, 20.0)
    for bad in ("gpu:0@1", "decode:-1@1", "decode:0", "decode@1", "decode:0@-1", "decode:0@nan", "decode:0@1+x",
                "decode:0@1+-2", "decode:0@1+"):
        with pytest.raises(ValueError, match="bad failure"):
            WorkerFailure.parse(bad)
    with pytest.raises(ValueError, match="has 1 decode workers"):
        ClusterConfig(1, 1, failures=(WorkerFailure("decode", 1, 0.0),))
    with pytest.raises(ValueError, match="max_migrations"):
        ClusterConfig(1, 1, max_migrations=-1)
    # One worker's outages may not overlap (a restart at the instant of the next death included):
    # the outcome would depend on the order they are listed.
    for pair in (("decode:0@1+10", "decode:0@2+1"), ("decode:0@1+5", "decode:0@2"), ("decode:0@1+0", "decode:0@1")):
        with pytest.raises(ValueError, match="overlap"):
            ClusterConfig(1, 1, failures=tuple(WorkerFailure.parse(f) for f in pair))
    ClusterConfig(1, 2, failures=tuple(WorkerFailure.parse(f) for f in ("decode:0@1+1", "decode:0@3", "decode:1@1")))


def test_the_search_sizes_a_cluster_that_rides_out_a_prefill_death(profile):
    trace = generate(15, 300, LengthDist("uniform", low=32, high=400), LengthDist("uniform", low=2, high=30), seed=2)
    slo = SLO(2.0, 0.2)
    plain = search(trace, profile, slo, SearchSpace(token_budgets=(512,), max_batches=(32,), max_workers=20))
    assert plain.best is not None and plain.best.config.prefill_workers == 1
    space = SearchSpace(token_budgets=(512,), max_batches=(32,), max_workers=20,
                        failures=(WorkerFailure("prefill", 0, 5.0),))
    plan = search(trace, profile, slo, space)
    assert plan.best is not None and plan.best.config.prefill_workers >= 2
    assert plan.best.summary.failed == 0 and plan.best.config.failures == space.failures
    assert any(c.summary.failed for c in plan.tried if c.config.prefill_workers == 1)


def test_a_one_token_request_whose_kv_was_landing_is_done_not_moved(profile):
    """Its only token came with the prefill; its decode worker dies before the KV lands (the
    transfer latency): nothing is left to generate, so it finishes there and does not move."""
    p = profile
    first = p.coordinator_overhead_s + prefill_s(p, 100)
    res = simulate([Request(0.0, 100, 1)], p,
                   ClusterConfig(1, 2, failures=(WorkerFailure("decode", 0, first + p.transfer_latency_s / 2),)))
    assert res.summary.failed == res.summary.migrations == 0
    assert res.times[0].finish_s == res.times[0].first_token_s == pytest.approx(first)


# -- a frozen worker: alive to the coordinator until its heartbeat deadline ---------------------


def test_a_frozen_decode_worker_moves_its_request_when_noticed(profile):
    """The same death as above, but frozen: the request's tokens stop at the freeze and it moves
    only when the death is noticed `n` seconds later; the cluster is otherwise idle, so the
    rest of its run is the prompt death's, shifted by n, and the gap across grows by n."""
    p, prompt, output, n = profile, 300, 20, 3.0
    landed = p.coordinator_overhead_s + prefill_s(p, prompt) + p.transfer_latency_s
    at = landed + steps_s(p, prompt + 1, 6) + 0.5 * p.decode_step_s(1, prompt + 7)
    config = lambda f: ClusterConfig(1, 2, failures=(f,))  # noqa: E731
    dead = simulate([Request(0.0, prompt, output)], p, config(WorkerFailure("decode", 0, at)))
    frozen = simulate([Request(0.0, prompt, output)], p,
                      config(WorkerFailure("decode", 0, at, noticed_after_s=n)))
    a, b = dead.times[0], frozen.times[0]
    assert b.first_token_s == pytest.approx(a.first_token_s)
    assert b.finish_s == pytest.approx(a.finish_s + n)
    assert frozen.summary.migrations == 1 and frozen.summary.failed == 0
    assert max(v for v, _ in frozen.itl) == pytest.approx(max(v for v, _ in dead.itl) + n)
    assert sum(v * k for v, k in frozen.itl) == pytest.approx(b.finish_s - b.first_token_s)


def test_requests_placed_on_a_frozen_worker_wait_for_the_deadline_then_move(profile):
    """Decode 1 freezes while idle, so it stays the least loaded: the next request is placed on
    it, prefilled (its first token comes as usual), and its KV never lands; it moves to
    decode 0 when the freeze is noticed, and its second token comes only after that."""
    p, n = profile, 2.0
    trace = [Request(0.0, 200, 400), Request(1.0, 100, 10)]  # the first keeps decode 0 busy
    res = simulate(trace, p, ClusterConfig(1, 2, failures=(
        WorkerFailure("decode", 1, 0.5, noticed_after_s=n),)))
    long, late = res.times
    solo = simulate([Request(1.0, 100, 10)], p, ClusterConfig(1, 1))
    assert late.first_token_s == pytest.approx(solo.times[0].first_token_s)
    assert late.finish_s > 0.5 + n
    assert res.summary.migrations == 1 and res.summary.failed == 0
    # Without the freeze the same request is placed on the idle decode 1 and done long before.
    calm = simulate(trace, p, ClusterConfig(1, 2))
    assert calm.times[1].finish_s < 0.5 + n < late.finish_s


def test_a_frozen_prefill_worker_loses_its_pass_and_its_queue_moves(profile):
    """Prefill 0 freezes mid-pass: the pass is lost, nothing more is prefilled there, and when
    the freeze is noticed its request is prefilled again on prefill 1."""
    p, n = profile, 1.5
    first = p.coordinator_overhead_s + prefill_s(p, 400)
    at = p.coordinator_overhead_s + 0.5 * prefill_s(p, 400)
    res = simulate([Request(0.0, 400, 5)], p, ClusterConfig(2, 1, failures=(
        WorkerFailure("prefill", 0, at, noticed_after_s=n),)))
    assert res.times[0].first_token_s == pytest.approx(at + n + prefill_s(p, 400))
    assert res.times[0].first_token_s > first + n
    assert res.summary.migrations == 1 and res.prefill_passes == 2


def test_a_frozen_worker_restarted_serves_again(profile):
    trace = generate(10, 60, LengthDist("uniform", low=16, high=300), LengthDist("uniform", low=2, high=30), seed=5)
    res = simulate(trace, profile, ClusterConfig(1, 2, failures=(
        WorkerFailure("decode", 0, 1.0, restart_after_s=4.0, noticed_after_s=3.0),)))
    assert res.summary.failed == 0 and len(res.times) == len(trace)


def test_bad_freezes_are_refused():
    with pytest.raises(ValueError, match="noticed_after_s must be a finite time"):
        WorkerFailure("decode", 0, 1.0, noticed_after_s=-1)
    with pytest.raises(ValueError, match="a freeze that thaws must last > 0 s"):
        WorkerFailure("decode", 0, 1.0, restart_after_s=0.0, noticed_after_s=3.0)
    assert WorkerFailure("decode", 0, 1.0, restart_after_s=2.0, noticed_after_s=3.0).thaws
    assert not WorkerFailure("decode", 0, 1.0, restart_after_s=3.0, noticed_after_s=3.0).thaws
    assert not WorkerFailure("decode", 0, 1.0, restart_after_s=2.0).thaws  # a death, then a restart
    assert WorkerFailure.parse("prefill:1@4+9", noticed_after_s=3.0) == WorkerFailure("prefill", 1, 4.0, 9.0, 3.0)


# -- a freeze that thaws before the heartbeat deadline: nothing moves, the worker resumes -------


def test_a_decode_worker_thawed_before_its_deadline_resumes_its_batch(profile):
    """Frozen mid-step k + 1 for `n` seconds (under the 3 s deadline): nothing moves; the lost
    part of that step is computed again after the thaw, so the request ends n plus that part
    later than without the freeze, and its gap across the freeze is one ITL."""
    p, prompt, output, n, k = profile, 300, 20, 0.7, 6
    landed = p.coordinator_overhead_s + prefill_s(p, prompt) + p.transfer_latency_s
    before = landed + steps_s(p, prompt + 1, k)  # the k-th decode token
    at = before + 0.5 * p.decode_step_s(1, prompt + 1 + k)
    res = simulate([Request(0.0, prompt, output)], p, ClusterConfig(1, 2, failures=(
        WorkerFailure("decode", 0, at, restart_after_s=n, noticed_after_s=3.0),)))
    r = res.times[0]
    assert res.summary.migrations == res.summary.failed == 0 and res.prefill_passes == 1
    assert r.first_token_s == pytest.approx(p.coordinator_overhead_s + prefill_s(p, prompt))
    assert r.finish_s == pytest.approx(at + n + steps_s(p, prompt + 1 + k, output - 1 - k))
    across = at + n + p.decode_step_s(1, prompt + 1 + k) - before
    assert max(v for v, _ in res.itl) == pytest.approx(across)
    assert sum(c for _, c in res.itl) == output - 1
    assert sum(v * c for v, c in res.itl) == pytest.approx(r.finish_s - r.first_token_s)


def test_a_prefill_worker_thawed_before_its_deadline_finishes_its_pass(profile):
    """Frozen halfway through the only pass of a prompt: the pass goes on with its other half
    at the thaw, so the first token is exactly n later; one pass, nothing moved."""
    p, n = profile, 1.2
    first = p.coordinator_overhead_s + prefill_s(p, 400)
    at = p.coordinator_overhead_s + 0.5 * prefill_s(p, 400)
    res = simulate([Request(0.0, 400, 5)], p, ClusterConfig(2, 1, failures=(
        WorkerFailure("prefill", 0, at, restart_after_s=n, noticed_after_s=3.0),)))
    assert res.times[0].first_token_s == pytest.approx(first + n)
    assert res.summary.migrations == 0 and res.prefill_passes == 1
    assert res.prefill_busy * res.summary.duration_s * 2 == pytest.approx(prefill_s(p, 400))


def test_kv_landing_on_a_frozen_decode_worker_moves_after_the_thaw(profile):
    """Decode 0 freezes before the request's KV starts to move and thaws at 1 s: the first
    token comes as usual (the prefill worker computes on), and the whole transfer happens
    after the thaw (a frozen receiver grants and acknowledges nothing); the decode steps run
    from there."""
    p, prompt, output = profile, 100, 10
    first = p.coordinator_overhead_s + prefill_s(p, prompt)
    res = simulate([Request(0.0, prompt, output)], p, ClusterConfig(1, 1, failures=(
        WorkerFailure("decode", 0, 0.0005, restart_after_s=0.9995, noticed_after_s=3.0),)))
    r = res.times[0]
    assert 0.0005 < p.coordinator_overhead_s and first + p.transfer_latency_s < 1.0
    assert r.first_token_s == pytest.approx(first)
    landed = 1.0 + prompt * p.kv_bytes_per_token / p.transfer_bytes_per_s + p.transfer_latency_s
    assert r.finish_s == pytest.approx(landed + steps_s(p, prompt + 1, output - 1))
    assert res.summary.migrations == 0


def test_a_second_freeze_right_after_a_thaw_keeps_the_gap_across_both(profile):
    """Frozen, thawed, and frozen again before the first step after the thaw ends: the gap
    from the last token before the first freeze to the next one is one ITL, and the ITL
    record still adds up (a review found it lost the first gap)."""
    p, prompt, output = profile, 300, 20
    landed = p.coordinator_overhead_s + prefill_s(p, prompt) + p.transfer_latency_s
    before = landed + steps_s(p, prompt + 1, 3)
    at = before + 0.5 * p.decode_step_s(1, prompt + 4)
    step = p.decode_step_s(1, prompt + 4)
    freezes = (WorkerFailure("decode", 0, at, 0.2, 3.0), WorkerFailure("decode", 0, at + 0.2 + step / 2, 0.3, 3.0))
    res = simulate([Request(0.0, prompt, output)], p, ClusterConfig(1, 1, failures=freezes))
    r = res.times[0]
    assert r.finish_s == pytest.approx(at + 0.2 + step / 2 + 0.3 + steps_s(p, prompt + 4, output - 4))
    assert sum(v * c for v, c in res.itl) == pytest.approx(r.finish_s - r.first_token_s)
    assert max(v for v, _ in res.itl) == pytest.approx(at + 0.5 + step / 2 + step - before)


def test_a_transfer_from_a_frozen_prefill_worker_resumes_after_the_thaw():
    """A transfer-bound profile: prefill 0 freezes while its finished prompt's KV streams and
    thaws 2.5 s later; the part left at the freeze moves after the thaw, so the request ends
    2.5 s later than without the freeze (a review found the freeze had cost nothing)."""
    from tests.planner.conftest import make_profile

    p = make_profile(transfer_bytes_per_s=1e5)
    trace = [Request(0.0, 1000, 5)]
    calm = simulate(trace, p, ClusterConfig(1, 1)).times[0]
    at = calm.first_token_s + 0.1  # the pass is done; the KV is still moving
    assert at < calm.first_token_s + 1000 * p.kv_bytes_per_token / p.transfer_bytes_per_s
    res = simulate(trace, p, ClusterConfig(1, 1, failures=(WorkerFailure("prefill", 0, at, 2.5, 3.0),)))
    assert res.times[0].first_token_s == pytest.approx(calm.first_token_s)
    assert res.times[0].finish_s == pytest.approx(calm.finish_s + 2.5)


def test_thawing_freezes_under_load_lose_nothing_and_cost_time(profile):
    """Random load with every worker frozen for a while, each thawed before its deadline:
    every request finishes, none moves, the ITL record adds up, and no request ends sooner
    than without the freezes... on average (a freeze can reorder the FIFO's packing)."""
    trace = generate(12, 150, LengthDist("uniform", low=16, high=900), LengthDist("uniform", low=2, high=60), seed=7)
    freezes = (WorkerFailure("decode", 0, 2.0, 0.8, 3.0), WorkerFailure("prefill", 1, 3.1, 2.5, 3.0),
               WorkerFailure("decode", 1, 5.0, 0.3, 3.0), WorkerFailure("decode", 0, 7.5, 1.0, 3.0))
    plain = simulate(trace, profile, ClusterConfig(2, 2, host_cores=2.0))
    frozen = simulate(trace, profile, ClusterConfig(2, 2, host_cores=2.0, failures=freezes))
    assert len(frozen.times) == len(trace)
    assert frozen.summary.migrations == frozen.summary.failed == 0
    assert sum(c for _, c in frozen.itl) == sum(t.output_tokens - 1 for t in frozen.times)
    assert sum(v * c for v, c in frozen.itl) == pytest.approx(
        sum(t.finish_s - t.first_token_s for t in frozen.times))
    assert frozen.summary.e2e_p50_s > plain.summary.e2e_p50_s
    assert max(v for v, _ in frozen.itl) > 0.8
