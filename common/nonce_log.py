"""The nonces of the cluster proofs a process has admitted (common/cluster_auth.py), kept as
long as their proofs could still be admitted, so that a captured proof opens one call, once.

A proof time-stamped TS is admitted while |now - TS| <= window; its nonce is kept until
TS + window and dropped after (the proof is stale by then, refused whatever the log says).
Memory is bounded by the rate of admitted calls times at most twice the window: only holders
of the secret can make a proof that gets this far, so a stranger cannot fill it.
Thread-safe: a process's gRPC servers may run on more than one event loop.
"""

from __future__ import annotations

import heapq
import threading


class NonceLog:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce -> its proof's time stamp
        self._expiry: list[tuple[float, str]] = []  # (TS + window, nonce), a min-heap

    def first_use(self, nonce: str, ts: float, now: float) -> bool:
        """Record `nonce` of a proof stamped `ts`; False when it was recorded already."""
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                _, old = heapq.heappop(self._expiry)
                self._seen.pop(old, None)
            if nonce in self._seen:
                return False
            self._seen[nonce] = ts
            heapq.heappush(self._expiry, (ts + self.window_s, nonce))
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
