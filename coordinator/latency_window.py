"""The last few minutes of finished requests' latencies, for the page at /ui: TTFT, TPOT and
ITL percentiles per time bucket, and over the whole window.

Prometheus' histograms (coordinator/metrics.py) count since the start and in fixed buckets;
the page wants "what is it now", so this keeps recent samples instead. Memory is bounded
whatever the load: at most window_s / bucket_s buckets are kept (older ones are dropped as time
passes), and each bucket keeps at most `samples` values of each figure, a uniform sample of
what it saw (reservoir sampling, Vitter's algorithm R), with the count of what it saw so that
percentiles over several buckets weigh each by its traffic, not by its sample size.

Times are the wall clock (time.time), since the page labels its charts with them; a clock
step only makes some buckets look older or newer than they are.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

FIGURES = ("ttft", "tpot", "itl")
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


class Timings(Protocol):
    """What a window reads of a finished request: coordinator/metrics.py's RequestTimings
    (not imported: metrics.py holds the window, and imports go one way)."""

    prompt_tokens: int
    output_tokens: int
    itl: list[float]

    @property
    def ttft(self) -> float | None: ...

    @property
    def tpot(self) -> float | None: ...


@dataclass(frozen=True)
class WindowConfig:
    window_s: float = 300.0  # how far back the page looks
    bucket_s: float = 10.0  # one point of its charts
    samples: int = 512  # values kept per figure per bucket

    def __post_init__(self) -> None:
        if not (self.bucket_s > 0 and self.window_s >= self.bucket_s):
            raise ValueError(f"a latency window needs 0 < bucket_s <= window_s, got "
                             f"bucket_s={self.bucket_s!r}, window_s={self.window_s!r}")
        if self.samples < 1:
            raise ValueError(f"a latency window keeps at least 1 sample, got {self.samples!r}")

    @property
    def buckets(self) -> int:
        return math.ceil(self.window_s / self.bucket_s)


@dataclass
class _Reservoir:
    """A uniform sample of at most `cap` of the values added, and how many were added."""

    values: list[float] = field(default_factory=list)
    seen: int = 0

    def add(self, value: float, cap: int, rng: random.Random) -> None:
        self.seen += 1
        if len(self.values) < cap:
            self.values.append(value)
        else:
            slot = rng.randrange(self.seen)
            if slot < cap:
                self.values[slot] = value

    @property
    def weight(self) -> float:
        """How many values each kept one stands for."""
        return self.seen / len(self.values) if self.values else 0.0


@dataclass
class _Bucket:
    requests: int = 0
    errors: int = 0  # outcome "error"
    prompt_tokens: int = 0
    output_tokens: int = 0
    figures: dict[str, _Reservoir] = field(
        default_factory=lambda: {name: _Reservoir() for name in FIGURES})


def weighted_quantiles(reservoirs: list[_Reservoir]) -> dict[str, float] | None:
    """p50/p90/p99 (nearest rank) of the values of `reservoirs`, each value weighing what its
    reservoir saw over what it kept; None when they hold nothing."""
    pairs = sorted((v, r.weight) for r in reservoirs for v in r.values)
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    out, cumulative, i = {}, 0.0, 0
    for name, q in QUANTILES:
        target = q * total
        while i < len(pairs) - 1 and cumulative + pairs[i][1] < target:
            cumulative += pairs[i][1]
            i += 1
        out[name] = pairs[i][0]
    return out


class LatencyWindow:
    def __init__(self, config: WindowConfig = WindowConfig(),
                 clock: Callable[[], float] = time.time, seed: int | None = None) -> None:
        self.config = config
        self._clock = clock
        self._rng = random.Random(seed)
        self._buckets: dict[int, _Bucket] = {}  # bucket index (time // bucket_s) -> bucket

    def _index(self, now: float) -> int:
        return math.floor(now / self.config.bucket_s)

    def _prune(self, now_index: int) -> None:
        oldest = now_index - self.config.buckets + 1
        for index in [i for i in self._buckets if i < oldest or i > now_index]:
            del self._buckets[index]

    def observe(self, timings: Timings, outcome: str) -> None:
        """One finished request (Metrics.observe_request): counted in the bucket of now."""
        index = self._index(self._clock())
        self._prune(index)
        bucket = self._buckets.setdefault(index, _Bucket())
        bucket.requests += 1
        bucket.errors += outcome == "error"
        bucket.prompt_tokens += timings.prompt_tokens
        bucket.output_tokens += timings.output_tokens
        cap, rng, figures = self.config.samples, self._rng, bucket.figures
        if timings.ttft is not None:
            figures["ttft"].add(timings.ttft, cap, rng)
        if timings.tpot is not None:
            figures["tpot"].add(timings.tpot, cap, rng)
        for gap in timings.itl:
            figures["itl"].add(gap, cap, rng)

    def report(self) -> dict:
        """JSON-ready: every bucket of the window, oldest first (empty ones too, so a chart's
        x axis is the same on every poll), and the window's totals and percentiles. Seconds."""
        cfg = self.config
        now = self._clock()
        now_index = self._index(now)
        self._prune(now_index)
        series = []
        for index in range(now_index - cfg.buckets + 1, now_index + 1):
            bucket = self._buckets.get(index, _Bucket())
            series.append({
                "t": index * cfg.bucket_s, "requests": bucket.requests, "errors": bucket.errors,
                "prompt_tokens": bucket.prompt_tokens, "output_tokens": bucket.output_tokens,
                **{name: weighted_quantiles([bucket.figures[name]]) for name in FIGURES}})
        buckets = list(self._buckets.values())
        overall = {"requests": sum(b.requests for b in buckets),
                   "errors": sum(b.errors for b in buckets),
                   "output_tokens": sum(b.output_tokens for b in buckets)}
        for name in FIGURES:
            reservoirs = [b.figures[name] for b in buckets]
            overall[name] = weighted_quantiles(reservoirs)
            overall[f"{name}_count"] = sum(r.seen for r in reservoirs)
        return {"now": now, "window_s": cfg.window_s, "bucket_s": cfg.bucket_s,
                "series": series, "overall": overall}
