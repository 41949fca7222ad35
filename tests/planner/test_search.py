"""The search recommends a topology that meets the SLO, and no cheaper one does."""

from __future__ import annotations

import itertools

import pytest

from planner.metrics import SLO
from planner.search import SearchSpace, search
from planner.simulator import ClusterConfig, simulate
from planner.trace import LengthDist, generate

SLO_ = SLO(ttft_s=0.5, tpot_s=0.06)


@pytest.fixture
def trace():
    return generate(30.0, 600, LengthDist.parse("uniform:32:600"), LengthDist.parse("uniform:2:40"), seed=11)


@pytest.mark.parametrize("prefill_cost, decode_cost", [(1.0, 1.0), (1.0, 3.0)])
def test_best_meets_and_no_cheaper_topology_does(profile, trace, prefill_cost, decode_cost):
    space = SearchSpace(token_budgets=(256, 512), max_batches=(8, 32), max_workers=12,
                        prefill_cost=prefill_cost, decode_cost=decode_cost)
    plan = search(trace, profile, SLO_, space)
    best = plan.best
    assert best is not None and best.meets
    assert simulate(trace, profile, best.config, SLO_).summary.meets(SLO_)  # not a stale figure
    assert not [c for c in plan.tried if c.meets and c.cost < best.cost]
    # Brute force over every (P, D) cheaper than the answer, at every budget and batch cap.
    for b, m in itertools.product(space.token_budgets, space.max_batches):
        for p, d in itertools.product(range(1, 8), range(1, 8)):
            if p * prefill_cost + d * decode_cost < best.cost:
                s = simulate(trace, profile, ClusterConfig(p, d, b, m), SLO_).summary
                assert not s.meets(SLO_), (p, d, b, m)


def test_nothing_within_max_workers_is_reported(profile, trace):
    plan = search(trace, profile, SLO_, SearchSpace(token_budgets=(256,), max_batches=(8,), max_workers=2))
    assert plan.best is None and plan.tried


def test_search_space_is_validated():
    with pytest.raises(ValueError, match="max_workers"):
        SearchSpace(max_workers=1)
    with pytest.raises(ValueError):
        SearchSpace(token_budgets=())


def test_an_slo_below_the_solo_prefill_time_is_reported_unreachable_without_simulating(profile):
    trace = generate(1.0, 100, LengthDist.parse("4000"), LengthDist.parse("2"), seed=1)
    plan = search(trace, profile, SLO(ttft_s=0.1, tpot_s=1.0), SearchSpace(token_budgets=(512,), max_batches=(8,)))
    assert plan.best is None and plan.tried == ()
    assert plan.ttft_floor[512] > 0.1
