"""coordinator/latency_window.py: the recent latencies the page at /ui charts, on a fake clock."""

from __future__ import annotations

import pytest

from coordinator.latency_window import LatencyWindow, WindowConfig
from coordinator.metrics import Metrics, RequestTimings


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def timings(ttft: float, gaps: list[float], prompt_tokens: int = 5) -> RequestTimings:
    """A finished request that arrived at 0: first token at `ttft`, then one token per gap."""
    t = RequestTimings(arrival=0.0, prompt_tokens=prompt_tokens)
    now = ttft
    t.on_tokens(1, now)
    for gap in gaps:
        now += gap
        t.on_tokens(1, now)
    t.finished = now
    return t


def test_percentiles_of_one_bucket_are_nearest_rank():
    clock = Clock()
    window = LatencyWindow(WindowConfig(window_s=60, bucket_s=10), clock=clock, seed=0)
    for i in range(1, 101):  # TTFTs 1..100 s
        window.observe(timings(float(i), [0.5, 0.5]), "stop")
    report = window.report()
    assert report["overall"]["ttft"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert report["overall"]["ttft_count"] == 100
    assert report["overall"]["itl"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert report["overall"]["itl_count"] == 200
    assert report["overall"]["requests"] == 100 and report["overall"]["output_tokens"] == 300
    assert report["series"][-1]["ttft"]["p50"] == 50.0
    assert report["series"][-1]["prompt_tokens"] == 500


def test_series_covers_the_window_and_old_buckets_age_out():
    clock = Clock(1005.0)
    window = LatencyWindow(WindowConfig(window_s=60, bucket_s=10), clock=clock)
    window.observe(timings(0.2, [0.1]), "stop")
    clock.now += 25
    window.observe(timings(0.4, [0.1]), "error")
    report = window.report()
    series = report["series"]
    assert len(series) == 6 and [b["t"] for b in series] == [980 + 10 * i for i in range(6)]
    assert [b["requests"] for b in series] == [0, 0, 1, 0, 0, 1]
    assert series[0]["ttft"] is None and series[2]["ttft"]["p50"] == pytest.approx(0.2)
    assert report["overall"]["errors"] == 1
    clock.now += 40  # the first request's bucket is now older than the window
    report = window.report()
    assert report["overall"]["requests"] == 1 and report["series"][-5]["requests"] == 1
    clock.now += 3600
    report = window.report()
    assert report["overall"]["requests"] == 0 and report["overall"]["ttft"] is None
    assert len(window._buckets) == 0  # nothing outside the window is kept


def test_memory_is_bounded_per_bucket_and_the_sample_stays_uniform():
    window = LatencyWindow(WindowConfig(window_s=10, bucket_s=10, samples=256),
                           clock=Clock(), seed=1)
    gaps = [i / 10_000 for i in range(10_000)]  # uniform on [0, 1)
    window.observe(timings(0.1, gaps), "length")
    bucket = next(iter(window._buckets.values()))
    assert len(bucket.figures["itl"].values) == 256 and bucket.figures["itl"].seen == 10_000
    itl = window.report()["overall"]["itl"]
    assert itl["p50"] == pytest.approx(0.5, abs=0.1) and itl["p90"] == pytest.approx(0.9, abs=0.06)


def test_buckets_weigh_by_what_they_saw_not_by_what_they_kept():
    clock = Clock(1000.0)
    window = LatencyWindow(WindowConfig(window_s=60, bucket_s=10, samples=10), clock=clock)
    window.observe(timings(0.1, [1.0] * 1000), "stop")  # 1000 gaps of 1 s, 10 kept
    clock.now += 10
    window.observe(timings(0.1, [2.0] * 10), "stop")  # 10 gaps of 2 s, all kept
    # Of 1010 gaps, 10 are 2 s: p90 and p99 are 1 s. Counting kept samples alone would say 2.
    # (approx: a gap is a difference of accumulated token times, 1 s to within ~1e-10, and
    # which ones the unseeded sample keeps varies from run to run.)
    assert window.report()["overall"]["itl"] == pytest.approx({"p50": 1.0, "p90": 1.0, "p99": 1.0}, abs=1e-6)


def test_a_request_without_tokens_counts_but_adds_no_latency():
    window = LatencyWindow(clock=Clock())
    window.observe(RequestTimings(arrival=0.0), "error")
    overall = window.report()["overall"]
    assert overall["requests"] == 1 and overall["errors"] == 1
    assert overall["ttft"] is None and overall["tpot"] is None and overall["itl_count"] == 0


def test_metrics_feed_the_window():
    metrics = Metrics(["a", "b"])
    metrics.observe_request(timings(0.3, [0.05, 0.05]), "stop", "b")
    overall = metrics.recent.report()["overall"]
    assert overall["requests"] == 1 and overall["ttft"]["p50"] == pytest.approx(0.3)
    assert overall["tpot"]["p50"] == pytest.approx(0.05)


@pytest.mark.parametrize("config", [dict(bucket_s=0), dict(window_s=5, bucket_s=10),
                                    dict(samples=0)])
def test_a_window_that_cannot_hold_a_bucket_is_refused(config):
    with pytest.raises(ValueError, match="latency window"):
        WindowConfig(**config)


def test_the_cached_closed_buckets_give_what_a_fresh_count_gives():
    from coordinator.latency_window import FIGURES, weighted_quantiles
    clock = Clock(1000.0)
    window = LatencyWindow(WindowConfig(window_s=60, bucket_s=10, samples=8), clock=clock, seed=2)
    for step in range(9):  # buckets close as the clock moves; one step goes back into one
        clock.now += (7, 5, -12, 9, 3, 11, 2, -4, 6)[step]
        for i in range(step + 3):
            window.observe(timings(0.1 * (i + step), [0.01 * i] * (i + 1)), "stop")
        overall = window.report()["overall"]
        for name in FIGURES:
            fresh = weighted_quantiles([b.figures[name] for b in window._buckets.values()])
            assert overall[name] == fresh, (step, name)


def test_a_request_counted_in_a_closed_bucket_after_a_clock_step_is_not_lost():
    clock = Clock(1055.0)
    window = LatencyWindow(WindowConfig(window_s=60, bucket_s=10), clock=clock)
    window.observe(timings(0.1, [0.01]), "stop")
    assert window.report()["overall"]["ttft"]["p99"] == pytest.approx(0.1)
    clock.now -= 20  # a step back: this request lands in a bucket the window had closed
    window.observe(timings(0.9, [0.01]), "stop")
    clock.now += 20
    overall = window.report()["overall"]
    assert overall["requests"] == 2 and overall["ttft"]["p99"] == pytest.approx(0.9)
