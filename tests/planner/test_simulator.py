"""The simulator against closed forms: one request, M/D/1 queueing, chunking, packing, the
decode batch cap, KV capacity."""

from __future__ import annotations

import math
import random

import pytest

from planner.cost_profile import CostProfile
from planner.simulator import ClusterConfig, Simulator, simulate
from planner.trace import LengthDist, Request, generate


def decode_s(p: CostProfile, prompt: int, output: int) -> float:
    """output - 1 steps of one sequence alone, its context growing from prompt + 1."""
    return sum(p.decode_step_s(1, prompt + 1 + k) for k in range(output - 1))


def test_one_request_closed_form(profile):
    p, prompt, output = profile, 300, 10
    r = simulate([Request(1.0, prompt, output)], p, ClusterConfig(1, 1, token_budget=512)).times[0]
    prefill = p.prefill_pass_s(prompt, CostProfile.chunk_pairs(prompt, 0))
    assert r.ttft_s == pytest.approx(p.coordinator_overhead_s + prefill)
    # The KV streams during the pass; here it is slower than compute, so it lands after it.
    landed = max(prefill, prompt * p.kv_bytes_per_token / p.transfer_bytes_per_s) + p.transfer_latency_s
    assert r.e2e_s == pytest.approx(p.coordinator_overhead_s + landed + decode_s(p, prompt, output))
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (output - 1))


def test_one_token_request_finishes_at_its_first_token(profile):
    r = simulate([Request(0.0, 100, 1)], profile, ClusterConfig(1, 1)).times[0]
    assert r.finish_s == r.first_token_s and r.tpot_s is None


def test_long_prompt_is_cut_into_ceil_l_over_budget_passes(profile):
    prompt, budget = 1300, 512
    res = simulate([Request(0.0, prompt, 2)], profile, ClusterConfig(1, 1, token_budget=budget))
    assert res.prefill_passes == math.ceil(prompt / budget) == 3
    chunks = [(512, 0), (512, 512), (276, 1024)]  # (tokens, cached before them)
    expected = sum(profile.prefill_pass_s(n, CostProfile.chunk_pairs(n, ctx)) for n, ctx in chunks)
    assert res.times[0].ttft_s == pytest.approx(profile.coordinator_overhead_s + expected)


def test_short_prompts_are_packed_into_one_pass(profile):
    # The first starts a pass alone at once (a worker does not wait for company); the three
    # queued behind it fit one budget together and finish in the same pass.
    trace = [Request(0.0, 100, 2) for _ in range(4)]
    res = simulate(trace, profile, ClusterConfig(1, 1, token_budget=512))
    assert res.prefill_passes == 2
    assert len({t.first_token_s for t in res.times[1:]}) == 1
    first = profile.prefill_pass_s(100, CostProfile.chunk_pairs(100, 0))
    packed = profile.prefill_pass_s(300, 3 * CostProfile.chunk_pairs(100, 0))
    assert res.times[1].first_token_s == pytest.approx(profile.coordinator_overhead_s + first + packed)


def test_a_pass_overhead_holds_the_worker_and_a_coordinator_delay_does_not(profile):
    # The same 30 ms of serving, once in the coordinator and once in each prefill pass: alone,
    # a request cannot tell them apart; queued behind another's pass, it waits for that
    # pass's share too.
    from dataclasses import replace

    base = replace(profile, coordinator_overhead_s=0.0)
    in_coordinator = replace(base, coordinator_overhead_s=0.03)
    in_pass = replace(base, prefill_pass_overhead_s=0.03)
    config = ClusterConfig(1, 1, token_budget=512)
    alone = [Request(0.0, 200, 2)]
    assert simulate(alone, in_pass, config).times[0].ttft_s == pytest.approx(
        simulate(alone, in_coordinator, config).times[0].ttft_s)
    pair = [Request(0.0, 200, 2), Request(0.0, 100, 2)]
    second = simulate(pair, in_coordinator, config).times[1].ttft_s
    assert second == pytest.approx(0.03 + base.prefill_pass_s(200, CostProfile.chunk_pairs(200, 0))
                                   + base.prefill_pass_s(100, CostProfile.chunk_pairs(100, 0)))
    assert simulate(pair, in_pass, config).times[1].ttft_s == pytest.approx(second + 0.03)


def test_prefill_queue_matches_md1_at_low_load(profile):
    """prompt == budget: one request per pass, a deterministic service time S, Poisson
    arrivals: an M/D/1 queue, whose mean wait is rho * S / (2 (1 - rho))."""
    budget = 512
    p = CostProfile(**{**profile.__dict__, "coordinator_overhead_s": 0.0})
    service = p.prefill_pass_s(budget, CostProfile.chunk_pairs(budget, 0))
    rate = 0.3 / service
    trace = generate(rate, 20000, LengthDist("fixed", value=budget), LengthDist("fixed", value=2), seed=3)
    res = simulate(trace, p, ClusterConfig(1, 4, token_budget=budget))
    mean_ttft = sum(t.ttft_s for t in res.times) / len(res.times)
    rho = rate * service
    assert mean_ttft == pytest.approx(service + rho * service / (2 * (1 - rho)), rel=0.05)


class CapWatcher(Simulator):
    """Records the largest batch any decode worker ran."""
    largest = 0

    def boundary(self, t, d, resumed=False):
        super().boundary(t, d, resumed)
        self.largest = max(self.largest, self.decodes[d].running)


def test_decode_batch_cap_is_respected(profile):
    trace = [Request(0.001 * i, 16, 50) for i in range(40)]
    sim = CapWatcher(profile, ClusterConfig(4, 1, token_budget=512, max_batch=4))
    res = sim.run(trace)
    assert sim.largest == 4  # reached, never passed
    assert res.mean_decode_batch <= 4
    # 40 requests of 49 decode steps, 4 at a time: at least 10 * 49 steps of the one worker.
    assert sum(1 for _ in res.times) == 40
    assert max(t.finish_s for t in res.times) >= 10 * 49 * profile.decode_step_s(4, 4 * 17)


def test_kv_capacity_blocks_admission(profile):
    # Each request needs ceil((100 + 28) / 16) = 8 blocks; the pool holds 8: one at a time.
    trace = [Request(0.0, 100, 28), Request(0.0, 100, 28)]
    res = simulate(trace, profile, ClusterConfig(2, 1, kv_blocks_per_decode=8))
    first, second = res.times
    # The second is not even prefilled before the first has finished and freed its blocks.
    pass_s = profile.prefill_pass_s(100, CostProfile.chunk_pairs(100, 0))
    assert second.first_token_s == pytest.approx(first.finish_s + pass_s)
    # With room for both, they run side by side.
    both = simulate(trace, profile, ClusterConfig(2, 1, kv_blocks_per_decode=16)).times
    assert both[1].first_token_s < first.finish_s


def test_request_larger_than_the_pool_is_rejected(profile):
    res = simulate([Request(0.0, 100, 28), Request(0.1, 1000, 10)], profile,
                   ClusterConfig(1, 1, kv_blocks_per_decode=8))
    assert res.summary.rejected == 1 and res.summary.requests == 1
    assert not res.summary.meets(__import__("planner.metrics").metrics.SLO(100, 100))


def test_more_workers_never_hurt_p99(profile):
    trace = generate(40, 3000, LengthDist("uniform", low=16, high=2000), LengthDist("uniform", low=1, high=64), seed=1)
    ttft = [simulate(trace, profile, ClusterConfig(n, 8)).summary.ttft_p99_s for n in (2, 3, 4)]
    tpot = [simulate(trace, profile, ClusterConfig(4, n)).summary.tpot_p99_s for n in (2, 3, 4)]
    assert ttft == sorted(ttft, reverse=True) and tpot == sorted(tpot, reverse=True)


def test_every_token_gap_is_counted_once(profile):
    """The ITL record holds output - 1 gaps per request, and the mean gap times their count
    is the decode time of all requests (first-token to finish)."""
    rng = random.Random(5)
    trace = sorted((Request(rng.uniform(0, 5), rng.randint(10, 600), rng.randint(1, 80)) for _ in range(300)),
                   key=lambda r: r.arrival_s)
    res = simulate(trace, profile, ClusterConfig(2, 2, max_batch=8))
    assert sum(w for _, w in res.itl) == sum(t.output_tokens - 1 for t in res.times)
    assert sum(v * w for v, w in res.itl) == pytest.approx(sum(t.finish_s - t.first_token_s for t in res.times))


def test_scale_thousands_of_workers(profile):
    """2,000 workers and 50,000 requests complete (how long it takes is not asserted)."""
    trace = generate(2000, 50000, LengthDist("lognormal", median=600, sigma=0.8, low=16, high=8000),
                     LengthDist("lognormal", median=150, sigma=0.7, low=1, high=1000), seed=7)
    res = simulate(trace, profile, ClusterConfig(1000, 1000, token_budget=1024, max_batch=128))
    assert res.summary.requests == 50000
    assert all(t.finish_s >= t.first_token_s >= t.arrival_s for t in res.times)


def test_a_shared_host_splits_its_cores_among_the_workers_computing(profile):
    """host_cores: processor sharing. A prefill pass that runs while the only core also decodes
    takes twice its profile's time; alone it takes its time; with background work beside it,
    (1 + background) / cores times it. host_cores 0 is a core per worker (as before)."""
    p = profile
    overhead = p.coordinator_overhead_s
    pass_s = p.prefill_pass_s(300, CostProfile.chunk_pairs(300, 0))
    alone = simulate([Request(0.0, 300, 2)], p, ClusterConfig(1, 1, host_cores=1)).times[0]
    assert alone.ttft_s == pytest.approx(overhead + pass_s)
    busy = simulate([Request(0.0, 300, 2)], p,
                    ClusterConfig(1, 1, host_cores=1, background_cores=0.5)).times[0]
    assert busy.ttft_s == pytest.approx(overhead + 1.5 * pass_s)
    assert busy.e2e_s - busy.ttft_s > alone.e2e_s - alone.ttft_s  # its decode step too
    # A decodes a long answer; B's prompt arrives while it does: B's pass shares the core.
    first = Request(0.0, 16, 4000)
    start_b = 1.0 + overhead + p.prefill_pass_s(16, CostProfile.chunk_pairs(16, 0))
    second = Request(start_b, 300, 2)
    shared = simulate([first, second], p, ClusterConfig(1, 1, host_cores=1)).times
    own = simulate([first, second], p, ClusterConfig(1, 1)).times
    assert own[1].ttft_s == pytest.approx(overhead + pass_s)
    assert shared[1].ttft_s == pytest.approx(overhead + 2 * pass_s)
    # A's steps ran at half speed while B's pass ran, then at full speed again.
    slower = shared[0].e2e_s - own[0].e2e_s
    assert 0.5 * pass_s < slower < 1.5 * pass_s
    with pytest.raises(ValueError, match="host_cores"):
        ClusterConfig(1, 1, host_cores=-1)


def test_a_shared_host_counts_a_pass_s_wall_time_as_busy_and_refuses_nan(profile):
    """prefill_busy is the share of the run a prefill worker computed: on a shared host a pass
    lasts longer than its cost, and that longer time is what the worker was busy."""
    trace = [Request(0.0, 300, 2)]
    own = simulate(trace, profile, ClusterConfig(1, 1))
    shared = simulate(trace, profile, ClusterConfig(1, 1, host_cores=1, background_cores=1.0))
    pass_s = profile.prefill_pass_s(300, CostProfile.chunk_pairs(300, 0))
    assert own.prefill_busy * own.summary.duration_s == pytest.approx(pass_s)
    assert shared.prefill_busy * shared.summary.duration_s == pytest.approx(2 * pass_s)
    with pytest.raises(ValueError, match="background_cores"):
        ClusterConfig(1, 1, background_cores=float("nan"))
