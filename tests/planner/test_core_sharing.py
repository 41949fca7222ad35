"""How a shared host's cores are shared where workers outnumber them (ClusterConfig.sharing):
a run queue per core, as Linux shares them (per_core), against processor sharing (even)."""

from __future__ import annotations

import pytest

from planner.cost_profile import CostProfile
from planner.simulator import ClusterConfig, simulate
from planner.trace import Request

# A decodes on decode worker 0 and B on decode worker 1, each for a long time; C's prompt is
# prefilled while both decode: three workers computing on two cores.
A = Request(0.0, 16, 2000)
B = Request(0.2, 16, 2000)
C_PROMPT = 1000


def _cluster(sharing: str, cores: int = 2, **kw) -> ClusterConfig:
    return ClusterConfig(1, 2, token_budget=4096, host_cores=cores, sharing=sharing, **kw)


def test_a_third_worker_shares_one_core_and_leaves_the_other_alone(profile):
    """per_core: C's pass joins one decode worker's core (the lowest of the least crowded),
    so it and that worker run at half speed while the other decode worker keeps its core;
    even: all three at 2/3."""
    p = profile
    pass_s = p.prefill_pass_s(C_PROMPT, CostProfile.chunk_pairs(C_PROMPT, 0))
    c = Request(1.0, C_PROMPT, 2)
    own = simulate([A, B, c], p, ClusterConfig(1, 2, token_budget=4096)).times
    per_core = simulate([A, B, c], p, _cluster("per_core")).times
    even = simulate([A, B, c], p, _cluster("even")).times
    overhead = p.coordinator_overhead_s
    assert own[2].ttft_s == pytest.approx(overhead + pass_s)
    assert per_core[2].ttft_s == pytest.approx(overhead + 2 * pass_s)
    assert even[2].ttft_s == pytest.approx(overhead + 1.5 * pass_s)
    # A's decode shared its core with C's pass (2 pass_s at half speed: pass_s of its own
    # work lost, to the step); B's never did, so B ran exactly as with a core per worker.
    step = p.decode_step_s(1, 16 + A.output_tokens)
    assert per_core[0].e2e_s - own[0].e2e_s == pytest.approx(pass_s, abs=2 * step)
    assert per_core[1].e2e_s == pytest.approx(own[1].e2e_s)
    # Even sharing slows both decode workers alike, by half as much each.
    for i in (0, 1):
        assert even[i].e2e_s - own[i].e2e_s == pytest.approx(0.5 * pass_s, abs=2 * step)


def test_a_core_that_goes_idle_takes_a_worker_from_a_crowded_one(profile):
    """When B finishes halfway through C's pass (at half speed), B's core takes C, the latest
    comer of the crowded core (the idle balance): C's pass runs at full speed from then."""
    p = profile
    pass_s = p.prefill_pass_s(C_PROMPT, CostProfile.chunk_pairs(C_PROMPT, 0))
    short_b = Request(B.arrival_s, B.prompt_tokens, 30)
    b_done = simulate([A, short_b], p, ClusterConfig(1, 2, token_budget=4096)).times[1].finish_s
    start = b_done - pass_s / 2  # C's pass starts here: half of its time at half speed
    c = Request(start - p.coordinator_overhead_s, C_PROMPT, 2)
    per_core = simulate([A, short_b, c], p, _cluster("per_core")).times
    assert per_core[1].finish_s == pytest.approx(b_done)  # B on its own core throughout
    # A quarter of the pass done by b_done, the rest at full speed.
    assert per_core[2].first_token_s == pytest.approx(b_done + 0.75 * pass_s)
    even = simulate([A, short_b, c], p, _cluster("even")).times
    # Even: 2/3 speed until b_done (a third done), then full speed; B slowed too, so later.
    assert even[2].first_token_s > b_done + (2 / 3 - 0.01) * pass_s


def test_background_work_takes_the_idle_cores_first(profile):
    """One worker computing on two cores with a core's worth of background: the background
    fits on the idle core, so the pass runs at its profile's speed; with every core busy it
    spreads over them."""
    p = profile
    pass_s = p.prefill_pass_s(300, CostProfile.chunk_pairs(300, 0))
    alone = [Request(0.0, 300, 2)]
    config = ClusterConfig(1, 1, host_cores=2, background_cores=1.0)
    assert simulate(alone, p, config).times[0].ttft_s == pytest.approx(p.coordinator_overhead_s + pass_s)
    one_core = ClusterConfig(1, 1, host_cores=1, background_cores=0.5)
    assert (simulate(alone, p, one_core).times[0].ttft_s
            == pytest.approx(p.coordinator_overhead_s + 1.5 * pass_s))
    # Two cores, both computing (a decode on one), 1.5 cores of background: no core is idle,
    # so all of it spreads, 0.75 on each core.
    first = Request(0.0, 16, 4000)
    second = Request(1.0, 300, 2)
    spill = simulate([first, second], p, ClusterConfig(1, 1, host_cores=2, background_cores=1.5)).times
    assert spill[1].ttft_s == pytest.approx(p.coordinator_overhead_s + 1.75 * pass_s)


def test_background_beside_a_crowded_core_adds_to_every_core(profile):
    """Three workers on two cores with a core's worth of background: no core is idle, so
    each carries half of it: C's pass, beside A's decode, at 1 / (2 + 0.5) of its speed
    (even sharing: 1 / ((3 + 1) / 2))."""
    p = profile
    pass_s = p.prefill_pass_s(C_PROMPT, CostProfile.chunk_pairs(C_PROMPT, 0))
    c = Request(1.0, C_PROMPT, 2)
    overhead = p.coordinator_overhead_s
    per_core = simulate([A, B, c], p, _cluster("per_core", background_cores=1.0)).times
    even = simulate([A, B, c], p, _cluster("even", background_cores=1.0)).times
    assert per_core[2].ttft_s == pytest.approx(overhead + 2.5 * pass_s)
    assert even[2].ttft_s == pytest.approx(overhead + 2.0 * pass_s)


def test_sharing_is_checked():
    with pytest.raises(ValueError, match="sharing must be one of per_core, even"):
        ClusterConfig(1, 1, host_cores=2, sharing="fair")
    for cores in (1.5, float("inf")):
        with pytest.raises(ValueError, match="whole number of cores"):
            ClusterConfig(1, 1, host_cores=cores)
    assert ClusterConfig(1, 1, host_cores=1.5, sharing="even").host_cores == 1.5


def test_a_pass_s_side_work_takes_an_idle_core_first_then_slows_the_workers(profile):
    """request_side_cpu_s: a remote prefill's CPU beside the compute threads, spread over its
    pass as background. On one core it adds itself to the pass; with a core idle beside the
    pass it runs there and costs nothing; a decode worker computing on that core shares it."""
    from dataclasses import replace

    p = replace(profile, request_side_cpu_s=0.04)
    prompt = 400
    pass_s = p.prefill_pass_s(prompt, CostProfile.chunk_pairs(prompt, 0))
    alone = [Request(0.0, prompt, 2)]
    one_core = ClusterConfig(1, 1, token_budget=4096, host_cores=1)
    two_cores = ClusterConfig(1, 1, token_budget=4096, host_cores=2)
    for sharing in ("per_core", "even"):
        ttft = simulate(alone, p, replace(one_core, sharing=sharing)).times[0].ttft_s
        assert ttft == pytest.approx(p.coordinator_overhead_s + pass_s + 0.04)
        ttft = simulate(alone, p, replace(two_cores, sharing=sharing)).times[0].ttft_s
        assert ttft == pytest.approx(p.coordinator_overhead_s + pass_s)
    # Each worker its own cores (a planned cluster): the side work is not the workers'.
    assert simulate(alone, p, ClusterConfig(1, 1, token_budget=4096)).times[0].ttft_s == \
        pytest.approx(p.coordinator_overhead_s + pass_s)
    # A decodes through C's pass on two cores: nothing idle, so the side work spreads over
    # both, and C's pass takes pass_s + 0.04 / 2 (the side work, half on its core).
    c = Request(1.0, C_PROMPT, 2)
    c_pass = p.prefill_pass_s(C_PROMPT, CostProfile.chunk_pairs(C_PROMPT, 0))
    times = simulate([A, c], p, ClusterConfig(1, 1, token_budget=4096, host_cores=2)).times
    assert times[1].ttft_s == pytest.approx(p.coordinator_overhead_s + c_pass + 0.02)
    base = simulate([A, c], profile, ClusterConfig(1, 1, token_budget=4096, host_cores=2)).times
    assert base[1].ttft_s == pytest.approx(p.coordinator_overhead_s + c_pass)
    # An empty prompt (a trace may hold one): a chunk of no tokens, no share, no division by 0.
    empty = simulate([Request(0.0, 0, 2)], p, one_core).times[0]
    assert empty.ttft_s == pytest.approx(p.coordinator_overhead_s + p.prefill_pass_s(0, 0.0))
