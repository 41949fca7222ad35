"""DESIGN.md's metric definitions: TPOT, goodput under an SLO, nearest-rank percentiles."""

from __future__ import annotations

import math

import pytest

from planner.metrics import SLO, RequestTimes, percentile, summarize, weighted_percentile


def test_tpot_is_decode_time_over_output_minus_one():
    r = RequestTimes(arrival_s=1.0, first_token_s=1.5, finish_s=3.5, output_tokens=5)
    assert r.ttft_s == 0.5 and r.e2e_s == 2.5 and r.tpot_s == pytest.approx(0.5)
    assert RequestTimes(0.0, 1.0, 1.0, 1).tpot_s is None


def test_goodput_counts_requests_that_met_both_bounds_per_second_of_the_run():
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    times = [RequestTimes(0.0, 0.5, 1.4, 10),   # TTFT 0.5, TPOT 0.1: meets (bounds are <=)
             RequestTimes(1.0, 2.5, 3.0, 6),    # TTFT 1.5: misses
             RequestTimes(2.0, 2.2, 4.2, 11),   # TPOT 0.2: misses
             RequestTimes(3.0, 3.9, 3.9, 1),    # one token: TTFT alone decides, meets
             RequestTimes(4.0, 4.1, 10.0, 2)]   # TPOT 5.9: misses; the run ends at 10.0
    s = summarize(times, [], slo)
    assert s.duration_s == 10.0
    assert s.goodput_rps == pytest.approx(2 / 10.0)
    assert s.throughput_rps == pytest.approx(5 / 10.0)
    assert s.slo_attainment == pytest.approx(0.4)
    assert s.output_tok_s == pytest.approx(30 / 10.0)
    assert not s.meets(slo)


def test_percentile_is_the_nearest_rank_bench_modes_uses():
    values = list(range(1, 101))
    assert percentile(values, 50) == 51  # round(0.5 * 99) = 50 (banker's) -> index 50
    assert percentile(values, 99) == 99
    assert math.isnan(percentile([], 50))


def test_weighted_percentile_equals_the_expanded_list():
    pairs = [(0.03, 5), (0.01, 90), (0.2, 1), (0.02, 4)]
    expanded = [v for v, w in pairs for _ in range(w)]
    for q in (0, 10, 50, 90, 99, 100):
        assert weighted_percentile(pairs, q) == percentile(expanded, q)
