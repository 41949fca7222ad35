"""The counters behind `TransferStats`, shared by every sender and receiver: the I/O thread adds,
any thread reads a snapshot."""

from __future__ import annotations

import threading
from dataclasses import replace

from .base import TransferStats


class StatsCounter:
    """Thread-safe monotonic counters behind TransferStats."""

    def __init__(self, backend: str) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats(backend)

    def add(self, **deltas: float) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    def snapshot(self) -> TransferStats:
        with self._lock:
            return self._stats

