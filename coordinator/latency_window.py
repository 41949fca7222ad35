"""The last few minutes of finished requests' latencies, for the page at /ui: TTFT, TPOT and
ITL percentiles per time bucket, and over the whole window.

Prometheus' histograms (coordinator/metrics.py) count since the start and in fixed buckets;
the page wants "what is it now", so this keeps recent samples instead. Memory is bounded
whatever the load: at most window_s / bucket_s buckets are kept (older ones are dropped as
time passes; twice that after the clock steps back), and each bucket keeps at most `samples`
values of each figure, a uniform sample of what it saw (reservoir sampling, Li's algorithm L),
with the count of what it saw so that percentiles over several buckets weigh each by its
traffic, not by its sample size.

Times are the wall clock (time.time), since the page labels its charts with them; a clock
step makes some buckets look older or newer than they are, and one of more than the window
drops them.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

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
    """A uniform sample of at most `cap` of the values added, and how many were added.

    Li's Algorithm L: once full, it draws how many values to skip before the next one kept
    (a geometric jump), so a value costs a comparison, not a random draw; the sample is
    distributed as algorithm R's."""

    values: list[float] = field(default_factory=list)
    seen: int = 0
    _w: float = 0.0
    _next: int = 0  # the `seen` count at which the next value is kept

    def add(self, value: float, cap: int, rng: random.Random) -> None:
        self.seen += 1
        if len(self.values) < cap:
            self.values.append(value)
            if len(self.values) == cap:
                self._w = math.exp(math.log(_open(rng)) / cap)
                self._jump(rng)
        elif self.seen == self._next:
            self.values[rng.randrange(cap)] = value
            self._w *= math.exp(math.log(_open(rng)) / cap)
            self._jump(rng)

    def _jump(self, rng: random.Random) -> None:
        # log1p(-w) < 0 for 0 < w < 1; w rounds to 1.0 only when cap is huge next to seen
        skip = math.floor(math.log(_open(rng)) / math.log1p(-self._w)) if self._w < 1 else 0
        self._next = self.seen + skip + 1

    @property
    def weight(self) -> float:
        """How many values each kept one stands for."""
        return self.seen / len(self.values) if self.values else 0.0


def _open(rng: random.Random) -> float:
    """Uniform on (0, 1): a log of it is finite."""
    return rng.random() or 0.5


@dataclass
class _Bucket:
    requests: int = 0
    errors: int = 0  # outcome "error"
    prompt_tokens: int = 0
    output_tokens: int = 0
    figures: dict[str, _Reservoir] = field(
        default_factory=lambda: {name: _Reservoir() for name in FIGURES})
    # Its figures' quantiles once computed; a bucket the clock has left gets no more values
    # (one that does, after a clock step back, drops this), so each poll computes only the
    # current bucket's and the window's.
    quantiles: dict[str, dict[str, float] | None] | None = None


def _arrays(reservoirs: list[_Reservoir]) -> tuple[np.ndarray, np.ndarray]:
    """The values of `reservoirs` and the weight of each: what its reservoir saw over what it
    kept."""
    full = [r for r in reservoirs if r.values]
    if not full:
        return np.empty(0), np.empty(0)
    return (np.concatenate([np.asarray(r.values, dtype=np.float64) for r in full]),
            np.concatenate([np.full(len(r.values), r.weight) for r in full]))


def _quantiles(values: np.ndarray, weights: np.ndarray) -> dict[str, float] | None:
    """p50/p90/p99, nearest rank: the smallest value whose cumulative weight reaches q of the
    total; None without values."""
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    picks = np.searchsorted(cumulative, [q * cumulative[-1] for _, q in QUANTILES], side="left")
    picks = np.minimum(picks, len(values) - 1)  # rounding in the sum must not step past the end
    return {name: float(values[order[i]]) for (name, _), i in zip(QUANTILES, picks)}


def weighted_quantiles(reservoirs: list[_Reservoir]) -> dict[str, float] | None:
    """p50/p90/p99 of the values of `reservoirs`, each weighing what its reservoir saw over
    what it kept; None when they hold nothing."""
    return _quantiles(*_arrays(reservoirs))


class LatencyWindow:
    def __init__(self, config: WindowConfig = WindowConfig(),
                 clock: Callable[[], float] = time.time, seed: int | None = None) -> None:
        self.config = config
        self._clock = clock
        self._rng = random.Random(seed)
        self._buckets: dict[int, _Bucket] = {}  # bucket index (time // bucket_s) -> bucket
        # The window's buckets before the current one, as arrays per figure, and the current
        # bucket index they were taken at: each poll then converts only the current bucket's
        # values (a full window is 30 x 512 values a figure, on the coordinator's event loop).
        self._closed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._closed_at: int | None = None

    def _index(self, now: float) -> int:
        return math.floor(now / self.config.bucket_s)

    def _prune(self, now_index: int) -> None:
        # The old, and those more than a window ahead: a bucket a little ahead of the clock
        # (it stepped back) still counts, and shows in the series once the clock is there
        # again. So at most two windows of buckets are ever kept.
        oldest, newest = now_index - self.config.buckets + 1, now_index + self.config.buckets
        for index in [i for i in self._buckets if not oldest <= i <= newest]:
            del self._buckets[index]

    def observe(self, timings: Timings, outcome: str) -> None:
        """One finished request (Metrics.observe_request): counted in the bucket of now."""
        index = self._index(self._clock())
        self._prune(index)
        bucket = self._buckets.setdefault(index, _Bucket())
        bucket.quantiles = None
        if index != self._closed_at:
            self._closed_at = None  # a bucket the cache holds (after a clock step) or a new one
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
            quantiles = bucket.quantiles or {name: weighted_quantiles([bucket.figures[name]])
                                             for name in FIGURES}
            if index < now_index and bucket.requests:
                bucket.quantiles = quantiles
            series.append({
                "t": index * cfg.bucket_s, "requests": bucket.requests, "errors": bucket.errors,
                "prompt_tokens": bucket.prompt_tokens, "output_tokens": bucket.output_tokens,
                **quantiles})
        buckets = list(self._buckets.values())
        overall = {"requests": sum(b.requests for b in buckets),
                   "errors": sum(b.errors for b in buckets),
                   "output_tokens": sum(b.output_tokens for b in buckets)}
        if self._closed_at != now_index:
            closed = [b for i, b in self._buckets.items() if i != now_index]
            self._closed = {name: _arrays([b.figures[name] for b in closed]) for name in FIGURES}
            self._closed_at = now_index
        current = self._buckets.get(now_index)
        for name in FIGURES:
            values, weights = self._closed[name]
            if current is not None:
                now_values, now_weights = _arrays([current.figures[name]])
                values = np.concatenate([values, now_values])
                weights = np.concatenate([weights, now_weights])
            overall[name] = _quantiles(values, weights)
            overall[f"{name}_count"] = sum(b.figures[name].seen for b in buckets)
        return {"now": now, "window_s": cfg.window_s, "bucket_s": cfg.bucket_s,
                "series": series, "overall": overall}
