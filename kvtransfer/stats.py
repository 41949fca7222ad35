"""The counters behind `TransferStats`, shared by every sender and receiver: the I/O thread adds,
any thread reads a snapshot."""

from __future__ import annotations

import threading
from dataclasses import fields

from .base import TransferStats


class StatsCounter:
    """Thread-safe monotonic counters behind TransferStats."""

    def __init__(self, backend: str) -> None:
        self._lock = threading.Lock()
        self._backend = backend
        # Plain counters, a TransferStats only per snapshot: add() runs once per unit on the
        # I/O threads, where rebuilding a frozen dataclass each time showed in profiles.
        self._counts = {f.name: f.default for f in fields(TransferStats) if f.name != "backend"}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(self._backend, **self._counts)

