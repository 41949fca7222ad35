"""Admission: at most `limit()` requests run at once; at most `max_queue` wait; the rest are
refused at once with `Overloaded` (HTTP 503 + Retry-After). Nothing here grows without bound.

    acquire() --slot free and nobody waiting--> running
              --queue has room--------------> waiting (FIFO) --slot freed--> running
                                                             --queue_timeout_s--> Overloaded
              --queue full------------------> Overloaded

`limit` is a callable because capacity follows the live workers (placement.concurrency_limit);
`wake()` is called when it may have grown (a worker registered) and on every release.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import AsyncIterator

from common.errors import TandemError


class Overloaded(TandemError):
    """No slot for the request now; the client should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyStreams(Overloaded):
    """More requests open at once than config.max_streams (HTTP 429)."""


class Admission:
    def __init__(self, limit: Callable[[], int], max_queue: int, queue_timeout_s: float,
                 retry_after_s: int = 1) -> None:
        self._limit = limit
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a slot for the body; yields the seconds spent waiting in the queue."""
        waited = await self.acquire()
        try:
            yield waited
        finally:
            self.release()

    async def acquire(self) -> float:
        start = time.monotonic()
        if not self._waiters and self.running < self._limit():
            self.running += 1
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(f"server overloaded: {self.running} requests running and "
                             f"{len(self._waiters)} queued (limit {self.max_queue})",
                             self.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted just as we gave up: hand the slot on
            else:
                waiter.cancel()
                self._waiters.remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(f"server overloaded: no slot within {self.queue_timeout_s:g} s",
                             self.retry_after_s) from None
        return time.monotonic() - start

    def release(self) -> None:
        self.running -= 1
        self.wake()

    def wake(self) -> None:
        """Grant slots to waiters, oldest first, while capacity allows."""
        while self._waiters and self.running < self._limit():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)
