"""Serving metrics: Prometheus series on a private registry (GET /metrics), and the per-request
figures (`RequestTimings`) that the final response carries.

Definitions (DESIGN.md): TTFT = arrival -> first content token leaving the coordinator;
TPOT = (end-to-end - TTFT) / (output tokens - 1); ITL = gaps between consecutive output tokens;
queue time = arrival -> admission slot granted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.registry import ROLES, WorkerRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

OUTCOMES = ("stop", "length", "error", "cancelled", "overloaded", "rejected")


@dataclass
class RequestTimings:
    """One request's clock readings (monotonic seconds) and the figures derived from them."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None  # first content token sent to the client
    last_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prefill_worker_s: float = 0.0  # PrefillResult.prefill_seconds; 0 for a local prefill
    itl: list[float] = field(default_factory=list)  # seconds between consecutive output tokens

    def on_tokens(self, count: int, now: float | None = None) -> None:
        """`count` tokens arrived together (one gap, then zero gaps inside the batch)."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.last_token is not None:
            self.itl.append(now - self.last_token)
        self.itl.extend([0.0] * (count - 1))
        self.first_token = self.first_token if self.first_token is not None else now
        self.last_token = now
        self.output_tokens += count

    def finish(self) -> None:
        self.finished = time.monotonic()

    @property
    def queue_time(self) -> float:
        return (self.admitted - self.arrival) if self.admitted is not None else 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return (self.finished or time.monotonic()) - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def eval_time(self) -> float:
        """First token to last: decode time."""
        if self.first_token is None or self.last_token is None:
            return 0.0
        return self.last_token - self.first_token


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_ttft_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("tandem_tpot_seconds", "Time per output token after the first",
                              registry=r, buckets=_TOKEN_BUCKETS)
        self.itl = Histogram("tandem_itl_seconds", "Gap between consecutive output tokens",
                             registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram("tandem_e2e_seconds", "Request arrival to last byte", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram("tandem_queue_seconds", "Time waiting for admission",
                                    registry=r, buckets=_LATENCY_BUCKETS)
        self.queue_depth = Gauge("tandem_queue_depth", "Requests waiting for admission",
                                 registry=r)
        self.running = Gauge("tandem_running_requests", "Requests admitted and running",
                             registry=r)
        self.requests = Counter("tandem_requests", "Finished requests by outcome", ["outcome"],
                                registry=r)
        self.kv_used = Gauge("tandem_worker_kv_blocks_used", "KV blocks in use (last heartbeat)",
                             ["worker"], registry=r)
        self.kv_free = Gauge("tandem_worker_kv_blocks_free", "Free KV blocks (last heartbeat)",
                             ["worker"], registry=r)
        self.live_workers = Gauge("tandem_live_workers", "Live workers by role", ["role"],
                                  registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros, so rates exist from the start

    def observe_request(self, timings: RequestTimings, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.e2e.observe(timings.e2e)
        if timings.admitted is not None:
            self.queue_time.observe(timings.queue_time)
        if timings.ttft is not None:
            self.ttft.observe(timings.ttft)
        if timings.tpot is not None:
            self.tpot.observe(timings.tpot)
        for gap in timings.itl:
            self.itl.observe(gap)

    def count_refusal(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self, workers: list[WorkerRecord], queue_depth: int, running: int) -> bytes:
        """The exposition text, with the gauges refreshed from the registry first."""
        self.queue_depth.set(queue_depth)
        self.running.set(running)
        live = dict.fromkeys(ROLES, 0)
        self.kv_used.clear()
        self.kv_free.clear()
        for w in workers:
            if not w.alive:
                continue
            live[w.role] += 1
            if w.load.num_blocks > 0:
                self.kv_used.labels(w.worker_id).set(w.load.num_blocks - w.load.num_free_blocks)
                self.kv_free.labels(w.worker_id).set(w.load.num_free_blocks)
        for role, count in live.items():
            self.live_workers.labels(role).set(count)
        return generate_latest(self.registry)
