"""Serving metrics: Prometheus series on a private registry (GET /metrics), and the per-request
figures (`RequestTimings`) that the final response carries.

Definitions (DESIGN.md): TTFT = arrival -> first content token leaving the coordinator;
TPOT = (end-to-end - TTFT) / (output tokens - 1); ITL = gaps between consecutive output tokens;
queue time = arrival -> admission slot granted.

KV traffic: the bytes each remotely prefilled request moved to its decode worker (only the
blocks that worker had not cached) and migrations, from the request flow; the workers' own
transfer counters, relayed from their heartbeats, per worker, role and backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.registry import ROLES, WorkerRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# 0 (the whole prompt was cached there), then 4 KiB to 4 GiB by factors of 4
_BYTE_BUCKETS = (0, *(4096 * 4 ** i for i in range(11)))

OUTCOMES = ("stop", "length", "error", "cancelled", "overloaded", "rejected")


@dataclass
class RequestTimings:
    """One request's clock readings (monotonic seconds) and the figures derived from them."""

    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    # Seconds this request waited for a live decode worker, i.e. for a model load (workers
    # register once loaded): Ollama's load_duration. 0.0 exactly when one was live on arrival.
    load_wait: float = 0.0
    first_token: float | None = None  # first content token sent to the client
    last_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Ollama's truncation (coordinator/prompts.py fit_chat): the oldest messages left out
    # so that the chat fits its context, and the prompt tokens that saved.
    truncated_messages: int = 0
    truncated_tokens: int = 0
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
        self.kv_bytes = Histogram("tandem_kv_transfer_bytes_per_request",
                                  "KV bytes moved to the decode worker per remotely prefilled "
                                  "request (its uncached blocks only)", ["worker"], registry=r,
                                  buckets=_BYTE_BUCKETS)
        self.migrations = Counter("tandem_request_migrations",
                                  "Times a request moved to another worker after one died",
                                  registry=r)
        # The workers' own KV transfer counters (monotonic since each worker started), as of
        # their last heartbeat: gauges, because the coordinator only relays them.
        kv_labels = ["worker", "role", "backend"]
        self.kv_sent = Gauge("tandem_worker_kv_bytes_sent", "KV bytes the worker sent",
                             kv_labels, registry=r)
        self.kv_received = Gauge("tandem_worker_kv_bytes_received",
                                 "KV bytes the worker received", kv_labels, registry=r)
        self.kv_transfers = Gauge("tandem_worker_kv_transfers_total",
                                  "KV transfers the worker finished, by outcome",
                                  [*kv_labels, "outcome"], registry=r)
        self.kv_seconds = Gauge("tandem_worker_kv_transfer_seconds_sum",
                                "Sum of the worker's finished KV transfers' durations",
                                kv_labels, registry=r)
        self.kv_skipped = Gauge("tandem_worker_kv_skipped_blocks",
                                "KV blocks not moved because the receiver had them cached",
                                kv_labels, registry=r)
        self.kv_rejected = Gauge("tandem_worker_kv_auth_rejected",
                                 "KV frames and handshakes the worker refused for want of the "
                                 "cluster secret", kv_labels, registry=r)
        # Internal gRPC calls refused for want of a valid cluster proof (common/refused_calls.py):
        # the coordinator's own (process="coordinator") and each live worker's, as last reported.
        self.grpc_refused = Gauge("tandem_grpc_refused_calls",
                                  "Internal gRPC calls refused for want of a valid cluster proof",
                                  ["process", "method", "reason"], registry=r)
        self._kv_gauges = (self.kv_sent, self.kv_received, self.kv_transfers, self.kv_seconds,
                           self.kv_skipped, self.kv_rejected)
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

    def observe_transfer(self, decode_worker: str, kv_bytes: int, remote: bool,
                         migrations: int) -> None:
        """One finished request's KV traffic: its bytes when it was prefilled remotely (a local
        prefill moves none and would only dilute the sizes), and its migrations."""
        if decode_worker and remote:
            self.kv_bytes.labels(decode_worker).observe(kv_bytes)
        if migrations:
            self.migrations.inc(migrations)

    def count_refusal(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def render(self, workers: list[WorkerRecord], queue_depth: int, running: int,
               refused: dict[tuple[str, str], int] | None = None) -> bytes:
        """The exposition text, with the gauges refreshed from the registry first. `refused`:
        the coordinator's own refused internal calls, (method, reason) -> count."""
        self.queue_depth.set(queue_depth)
        self.running.set(running)
        live = dict.fromkeys(ROLES, 0)
        self.kv_used.clear()
        self.kv_free.clear()
        for gauge in self._kv_gauges:
            gauge.clear()
        self.grpc_refused.clear()
        for (method, reason), count in (refused or {}).items():
            self.grpc_refused.labels("coordinator", method, reason).set(count)
        for w in workers:
            if not w.alive:
                continue
            live[w.role] += 1
            if w.load.num_blocks > 0:
                self.kv_used.labels(w.worker_id).set(w.load.num_blocks - w.load.num_free_blocks)
                self.kv_free.labels(w.worker_id).set(w.load.num_free_blocks)
            if w.kv is not None:
                labels = (w.worker_id, w.role, w.kv.backend or w.kv_backend)
                self.kv_sent.labels(*labels).set(w.kv.bytes_sent)
                self.kv_received.labels(*labels).set(w.kv.bytes_received)
                self.kv_transfers.labels(*labels, "done").set(w.kv.transfers_done)
                self.kv_transfers.labels(*labels, "failed").set(w.kv.transfers_failed)
                self.kv_seconds.labels(*labels).set(w.kv.transfer_seconds)
                self.kv_skipped.labels(*labels).set(w.kv.skipped_blocks)
                self.kv_rejected.labels(*labels).set(w.kv.auth_rejected)
            for (method, reason), count in w.refused.items():
                self.grpc_refused.labels(w.worker_id, method, reason).set(count)
        for role, count in live.items():
            self.live_workers.labels(role).set(count)
        return generate_latest(self.registry)
