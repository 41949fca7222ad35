"""Counts of the internal gRPC calls a process refused (common/cluster_auth.py's interceptor;
the Registry's refusals of a live worker's id, coordinator/registry.py; the coordinator's
internal HTTP routes, method "GET /internal/workers", coordinator/ops_routes.py),
by method and reason, so a rogue or misconfigured peer shows on /metrics, not only in a log.

A worker sends its counts in every heartbeat (WorkerStatus.refused_calls); the coordinator
exports them with its own as tandem_grpc_refused_calls_total{process, method, reason}. Counts are
monotonic since the process started. Methods are the server's own registered names, so the
key set stays bounded whatever a caller sends: an unknown method never reaches the check.
"""

from __future__ import annotations

import threading

# check()'s message prefix -> the reason label (common/cluster_auth.py ClusterAuth.check).
REASONS = (("no cluster proof", "no_proof"), ("malformed", "malformed"),
           ("wrong cluster proof", "wrong_secret"), ("stale", "stale"),
           ("cluster proof of another request", "other_request"), ("replayed", "replayed"),
           ("worker id", "id_in_use"),  # coordinator/registry.py: a live worker's id claimed
           ("off this host", "off_host"))  # /internal/* without a secret: a remote peer


def reason_label(message: str) -> str:
    for prefix, label in REASONS:
        if message.startswith(prefix):
            return label
    return "other"


class RefusedCalls:
    """Thread-safe: gRPC servers count from their event loop, heartbeats read from theirs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, method: str, reason: str) -> None:
        key = (method, reason_label(reason))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """(method, reason label) -> calls refused so far."""
        with self._lock:
            return dict(self._counts)
