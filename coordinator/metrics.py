"""Serving metrics: Prometheus series on a private registry (GET /metrics), and the per-request
figures (`RequestTimings`) that the final response carries.

Definitions (DESIGN.md): TTFT = arrival -> first content token leaving the coordinator;
TPOT = (end-to-end - TTFT) / (output tokens - 1); ITL = gaps between consecutive output tokens;
queue time = arrival -> admission slot granted.

The request series carry vLLM's names, types, `model_name` label (one per model served: each
request counts under its own model, each model's queue, running count and KV usage over its
own workers) and bucket boundaries (vLLM v1's vllm/v1/metrics/loggers.py), so vLLM's Grafana dashboard, llm-d's scheduler and the
production-stack router read tandem as they read vLLM. As in vLLM v1,
vllm:time_per_output_token_seconds and vllm:inter_token_latency_seconds observe every gap
between tokens; vllm:request_time_per_output_token_seconds observes each request's TPOT. Prefix
cache queries and hits count prompt tokens (as vLLM v1): each finished request's prompt, and the
part of it its decode or prefill worker already held. vllm:num_preemptions_total is not
exported: the workers do not report preemptions.

tandem's own disaggregation series sit beside them: the KV bytes each remotely prefilled request
moved to its decode worker (only the blocks that worker had not cached) and migrations, from the
request flow; per worker, its KV blocks and queue as of its last heartbeat (gauges), and its KV
transfer counters and refused internal calls, monotonic since it started and relayed from its
heartbeats (counters, exported by a custom collector: a relayed value is set, never incremented).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from coordinator.latency_window import LatencyWindow
from coordinator.registry import ROLES, WorkerRecord

# vLLM v1's boundaries (vllm/v1/metrics/loggers.py), so its dashboards' quantiles line up.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# 0 (the whole prompt was cached there), then 4 KiB to 4 GiB by factors of 4
_BYTE_BUCKETS = (0, *(4096 * 4 ** i for i in range(11)))

OUTCOMES = ("stop", "length", "error", "cancelled", "overloaded", "rejected")
# tandem's outcome -> vLLM's finished_reason, for the requests vLLM counts as finished
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


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


class _ModelSeries:
    """vLLM's request series of one model: each family's child labelled with its model_name
    (one coordinator serves several models, each a model_name, as vLLM's router expects)."""

    def __init__(self, families: dict, success: Counter, model_name: str) -> None:
        for attr, family in families.items():
            setattr(self, attr, family.labels(model_name))
        self.success = {reason: success.labels(model_name, reason)
                        for reason in set(FINISHED_REASONS.values())}


class ModelMetrics:
    """What a Generation records, for one model's series (Metrics.of)."""

    def __init__(self, metrics: Metrics, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def observe_request(self, timings: RequestTimings, outcome: str) -> None:
        self.metrics.observe_request(timings, outcome, self.model_name)

    def observe_transfer(self, decode_worker: str, kv_bytes: int, remote: bool,
                         migrations: int) -> None:
        self.metrics.observe_transfer(decode_worker, kv_bytes, remote, migrations)


class Metrics:
    def __init__(self, model_names: str | Iterable[str]) -> None:
        """model_names: every model served (the first is the default)."""
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.model_name = names[0]

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, m, registry=r, buckets=buckets)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r)

        # ---- vLLM's series, one child per model ----------------------------------------------
        families = {
            "ttft": histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds", _TTFT_BUCKETS),
            "tpot_gaps": histogram("vllm:time_per_output_token_seconds",
                                   "Time per output token in seconds (every gap, as vLLM v1)",
                                   _TOKEN_BUCKETS),
            "itl": histogram("vllm:inter_token_latency_seconds",
                             "Gap between consecutive output tokens in seconds", _TOKEN_BUCKETS),
            "tpot": histogram("vllm:request_time_per_output_token_seconds",
                              "Each request's time per output token after the first",
                              _TOKEN_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds",
                             "Request arrival to last byte in seconds", _REQUEST_BUCKETS),
            "queue_time": histogram("vllm:request_queue_time_seconds",
                                    "Time waiting for admission in seconds", _REQUEST_BUCKETS),
            "waiting": gauge("vllm:num_requests_waiting", "Requests waiting for admission"),
            "running": gauge("vllm:num_requests_running", "Requests admitted and running"),
            "kv_usage": gauge("vllm:kv_cache_usage_perc",
                              "KV blocks in use over the live workers' pools (1 = 100 percent)"),
            "prompt_tokens": counter("vllm:prompt_tokens", "Prompt tokens of finished requests"),
            "generation_tokens": counter("vllm:generation_tokens", "Tokens generated"),
            "prefix_queries": counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens"),
            "prefix_hits": counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in prompt tokens found cached"),
        }
        success = Counter("vllm:request_success", "Requests finished, by vLLM's finished_reason",
                          [*m, "finished_reason"], registry=r)
        self._series = {name: _ModelSeries(families, success, name) for name in names}
        self._families, self._success = families, success  # add_model's

        # ---- tandem's own ----------------------------------------------------------------------
        self.queue_depth = Gauge("tandem_queue_depth", "Requests waiting for admission "
                                 "(vllm:num_requests_waiting without labels)", registry=r)
        self.requests = Counter("tandem_requests", "Finished requests by outcome", ["outcome"],
                                registry=r)
        self.kv_used = Gauge("tandem_worker_kv_blocks_used", "KV blocks in use (last heartbeat)",
                             ["worker"], registry=r)
        self.kv_free = Gauge("tandem_worker_kv_blocks_free", "Free KV blocks (last heartbeat)",
                             ["worker"], registry=r)
        self.worker_running = Gauge("tandem_worker_requests_running",
                                    "Requests running on the worker (last heartbeat)",
                                    ["worker", "role"], registry=r)
        self.worker_waiting = Gauge("tandem_worker_requests_waiting",
                                    "Requests queued on the worker (last heartbeat)",
                                    ["worker", "role"], registry=r)
        self.worker_queued_tokens = Gauge("tandem_worker_queued_prefill_tokens",
                                          "Prompt tokens the worker accepted but has not "
                                          "prefilled yet (last heartbeat)", ["worker", "role"],
                                          registry=r)
        self.live_workers = Gauge("tandem_live_workers", "Live workers by role", ["role"],
                                  registry=r)
        self.kv_bytes = Histogram("tandem_kv_transfer_bytes_per_request",
                                  "KV bytes moved to the decode worker per remotely prefilled "
                                  "request (its uncached blocks only)", ["worker"], registry=r,
                                  buckets=_BYTE_BUCKETS)
        self.migrations = Counter("tandem_request_migrations",
                                  "Times a request moved to another worker after one died",
                                  registry=r)
        self._relayed = _RelayedCounters()
        r.register(self._relayed)
        # The last minutes' latencies of every model's requests, for the page at /ui.
        self.recent = LatencyWindow()
        self._worker_gauges = (self.kv_used, self.kv_free, self.worker_running,
                               self.worker_waiting, self.worker_queued_tokens)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros, so rates exist from the start

    def add_model(self, model_name: str) -> None:
        """Series for a model loaded on request (kept after it is unloaded: counters of a
        model_name do not restart while the coordinator runs)."""
        if model_name not in self._series:
            self._series[model_name] = _ModelSeries(self._families, self._success, model_name)

    def of(self, model_name: str) -> ModelMetrics:
        """The recorder of one model's requests (a name given to Metrics)."""
        if model_name not in self._series:
            raise KeyError(f"no series for model {model_name!r}")
        return ModelMetrics(self, model_name)

    def observe_request(self, timings: RequestTimings, outcome: str,
                        model_name: str | None = None) -> None:
        """model_name: the model it was for (None: the default)."""
        s = self._series[model_name or self.model_name]
        self.requests.labels(outcome).inc()
        if outcome in FINISHED_REASONS:
            s.success[FINISHED_REASONS[outcome]].inc()
        s.prompt_tokens.inc(timings.prompt_tokens)
        s.generation_tokens.inc(timings.output_tokens)
        s.prefix_queries.inc(timings.prompt_tokens)
        s.prefix_hits.inc(timings.cached_tokens)
        s.e2e.observe(timings.e2e)
        if timings.admitted is not None:
            s.queue_time.observe(timings.queue_time)
        if timings.ttft is not None:
            s.ttft.observe(timings.ttft)
        if timings.tpot is not None:
            s.tpot.observe(timings.tpot)
        for gap in timings.itl:
            s.itl.observe(gap)
            s.tpot_gaps.observe(gap)
        self.recent.observe(timings, outcome)

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
               refused: dict[tuple[str, str], int] | None = None,
               per_model: dict[str, tuple[int, int, str]] | None = None) -> bytes:
        """The exposition text, with the gauges refreshed from the registry first. `refused`:
        the coordinator's own refused internal calls, (method, reason) -> count. per_model:
        model name -> (its queue depth, its requests running, its fingerprint), for the
        model_name gauges; None: all of `workers` and both counts are the default model's."""
        self.queue_depth.set(queue_depth)
        live_workers = [w for w in workers if w.alive]
        if per_model is None:
            per_model = {self.model_name: (queue_depth, running, None)}
        for name, (waiting, admitted, fingerprint) in per_model.items():
            s = self._series[name]
            s.waiting.set(waiting)
            s.running.set(admitted)
            pools = [w.load for w in live_workers if w.load.num_blocks > 0
                     and (fingerprint is None or w.model_fingerprint == fingerprint)]
            blocks = sum(p.num_blocks for p in pools)
            s.kv_usage.set(sum(p.num_blocks - p.num_free_blocks for p in pools) / blocks
                           if blocks else 0.0)
        live = dict.fromkeys(ROLES, 0)
        for gauge in self._worker_gauges:
            gauge.clear()
        for w in live_workers:
            live[w.role] += 1
            load = w.load
            self.worker_running.labels(w.worker_id, w.role).set(load.num_running)
            self.worker_waiting.labels(w.worker_id, w.role).set(load.num_waiting)
            self.worker_queued_tokens.labels(w.worker_id, w.role).set(load.queued_prefill_tokens)
            if load.num_blocks > 0:
                self.kv_used.labels(w.worker_id).set(load.num_blocks - load.num_free_blocks)
                self.kv_free.labels(w.worker_id).set(load.num_free_blocks)
        for role, count in live.items():
            self.live_workers.labels(role).set(count)
        self._relayed.workers, self._relayed.refused = live_workers, dict(refused or {})
        return generate_latest(self.registry)


class _RelayedCounters:
    """Counters the coordinator relays rather than counts: the live workers' KV transfer
    counters and refused internal calls, and the coordinator's own refused calls, as of the
    last `Metrics.render`. A worker that restarts starts from zero, which Prometheus reads as a
    counter reset."""

    def __init__(self) -> None:
        self.workers: list[WorkerRecord] = []
        self.refused: dict[tuple[str, str], int] = {}  # the coordinator's own

    def collect(self) -> Iterator[CounterMetricFamily]:
        kv_labels = ["worker", "role", "backend"]

        def family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        sent = family("tandem_worker_kv_sent_bytes", "KV bytes the worker sent", kv_labels)
        received = family("tandem_worker_kv_received_bytes", "KV bytes the worker received",
                          kv_labels)
        transfers = family("tandem_worker_kv_transfers", "KV transfers the worker finished, "
                           "by outcome", [*kv_labels, "outcome"])
        seconds = family("tandem_worker_kv_transfer_seconds",
                         "Seconds the worker's finished KV transfers took, summed", kv_labels)
        skipped = family("tandem_worker_kv_skipped_blocks",
                         "KV blocks not moved because the receiver had them cached", kv_labels)
        rejected = family("tandem_worker_kv_auth_rejected", "KV frames and handshakes the "
                          "worker refused for want of the cluster secret", kv_labels)
        # vLLM's names (vllm:spec_decode_*_total), per worker and proposer (ngram, draft).
        spec_labels = ["worker", "role", "method"]
        accepted = family("vllm:spec_decode_num_accepted_tokens",
                          "Draft tokens the target model accepted", spec_labels)
        drafted = family("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", spec_labels)
        drafts = family("vllm:spec_decode_num_drafts", "Verification passes of a request with "
                        "a draft", spec_labels)
        emitted = family("tandem_spec_decode_num_emitted_tokens", "Tokens the verification "
                         "passes emitted (accepted drafts + the target's own token)", spec_labels)
        calls = family("tandem_grpc_refused_calls", "Internal calls (gRPC, and HTTP /internal/*) "
                       "refused for want of a valid cluster proof", ["process", "method", "reason"])
        for (method, reason), count in self.refused.items():
            calls.add_metric(["coordinator", method, reason], count)
        for w in self.workers:
            if w.kv is not None:
                labels = [w.worker_id, w.role, w.kv.backend or w.kv_backend]
                sent.add_metric(labels, w.kv.bytes_sent)
                received.add_metric(labels, w.kv.bytes_received)
                transfers.add_metric([*labels, "done"], w.kv.transfers_done)
                transfers.add_metric([*labels, "failed"], w.kv.transfers_failed)
                seconds.add_metric(labels, w.kv.transfer_seconds)
                skipped.add_metric(labels, w.kv.skipped_blocks)
                rejected.add_metric(labels, w.kv.auth_rejected)
            if w.spec is not None:
                spec = [w.worker_id, w.role, w.spec.method]
                accepted.add_metric(spec, w.spec.num_accepted_tokens)
                drafted.add_metric(spec, w.spec.num_draft_tokens)
                drafts.add_metric(spec, w.spec.num_steps)
                emitted.add_metric(spec, w.spec.num_emitted_tokens)
            for (method, reason), count in w.refused.items():
                calls.add_metric([w.worker_id, method, reason], count)
        yield from (sent, received, transfers, seconds, skipped, rejected, accepted, drafted,
                    drafts, emitted, calls)
