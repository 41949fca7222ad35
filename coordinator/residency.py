"""Whether the served model's weights are loaded on the workers: Ollama's keep_alive.

Each request's keep_alive (parse_keep_alive; the server default is config.keep_alive_s, which
OLLAMA_KEEP_ALIVE sets) says how long the model stays loaded after it ends; the request that
ends last decides, as in Ollama. Life cycle, all on the coordinator's event loop:

  acquire()   before a request is dispatched: counts it in flight; when the model is unloaded,
              SetResident(true) to every live worker at once, the wait being the request's
              load_duration.
  release()   when it ends: the expiry becomes now + its keep_alive (never, for a negative one).
  run()       background task: once the expiry has passed with nothing in flight, SetResident
              (false) to every live worker, which drop their weights between two engine steps.
  unload()    keep_alive 0 with no prompt: expire now, and wait for the unload when idle.

A worker that registers while the model is unloaded holds its weights (workers load at start)
until the next expiry.

A model loaded on request (coordinator/on_demand.py) is unloaded by stopping its workers, not
by SetResident: its Residency has `on_expire`, called (on the loop, synchronously) where the
others send SetResident(false). Such a model is never loaded back here: once unloaded, acquire
raises ModelRetired, and the caller looks the model up again (which starts new workers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from datetime import datetime, timezone

import grpc

from coordinator.config import MAX_KEEP_ALIVE_S
from coordinator.registry import DECODE_ROLES, WorkerRecord, WorkerRegistry
from coordinator.request_flow import NoWorkers
from common.rpc import worker_pb2 as pb

log = logging.getLogger(__name__)

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class ModelRetired(Exception):
    """The model's workers are being stopped (it was unloaded); look it up again."""


class KeepAliveError(ValueError):
    """A keep_alive that is neither a number of seconds nor a duration such as "5m"."""


def parse_keep_alive(value) -> float | None:
    """keep_alive as seconds: a number is seconds, a string a Go duration ("5m", "1h30m",
    "300ms", "0"); negative = forever (math.inf); None when not given. KeepAliveError (a 400
    naming keep_alive) for anything else and for more than MAX_KEEP_ALIVE_S."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise KeepAliveError(f"keep_alive must be a duration or a number, got {value}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)  # a bare number, as seconds ("0", "300")
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise KeepAliveError(f'keep_alive {value!r} is not a duration (such as "5m" or '
                                     '"1h30m") or a number of seconds') from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
        seconds *= sign
    else:
        raise KeepAliveError(f"keep_alive must be a duration or a number, got {type(value).__name__}")
    if math.isnan(seconds):
        raise KeepAliveError(f"keep_alive must be a duration or a number, got {value!r}")
    if seconds > MAX_KEEP_ALIVE_S:
        raise KeepAliveError(f"keep_alive {str(value)[:40]!r} is out of range: at most 8760h "
                             "(a year); a negative keep_alive keeps the model loaded forever")
    return math.inf if seconds < 0 else seconds


class Residency:
    def __init__(self, registry: WorkerRegistry, default_keep_alive_s: float,
                 rpc_timeout_s: float, clock=time.monotonic,
                 on_expire: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.on_expire = on_expire
        self.default_keep_alive_s = default_keep_alive_s
        self.rpc_timeout_s = rpc_timeout_s
        self._clock = clock
        self.resident = True  # workers load their model at start-up
        self.in_flight = 0
        self.expires_at = clock() + default_keep_alive_s  # monotonic; math.inf = never
        self._switch = asyncio.Lock()  # one load or unload at a time
        self._changed = asyncio.Event()
        self.last_used = clock()  # a request's start or end: least recently used unloads first

    # ---- requests -------------------------------------------------------------------------------

    async def acquire(self) -> float:
        """Counts a request in flight, loading the model first when it is unloaded; returns the
        seconds spent waiting for the load (0.0 when it was loaded)."""
        self.last_used = self._clock()
        if not self.resident and self.on_expire is not None:
            raise ModelRetired("the model was unloaded")
        self.in_flight += 1
        if self.resident:
            return 0.0
        start = self._clock()
        try:
            async with self._switch:
                if not self.resident:
                    await self._set_all(True)
                    self.resident = True
        except BaseException:
            self.in_flight -= 1
            raise
        return self._clock() - start

    def release(self, keep_alive_s: float | None) -> None:
        self.in_flight -= 1
        keep = self.default_keep_alive_s if keep_alive_s is None else keep_alive_s
        self.last_used = self._clock()
        self.expires_at = self.last_used + keep
        self._changed.set()

    async def unload(self) -> None:
        """Ollama's explicit unload (keep_alive 0, no prompt): at once when idle, else as soon
        as the requests in flight end (unless a later one keeps it longer)."""
        self.expires_at = self._clock()
        self._changed.set()
        if self.in_flight == 0:
            await self._unload_if_expired()

    def expires_at_iso(self) -> str | None:
        """The expiry as UTC ISO 8601 for /api/ps; None when it never expires."""
        if math.isinf(self.expires_at):
            return None
        at = max(self.expires_at, self._clock()) if self.in_flight else self.expires_at
        wall = time.time() + (at - self._clock())
        return datetime.fromtimestamp(wall, timezone.utc).isoformat().replace("+00:00", "Z")

    # ---- the expiry -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Unloads once the expiry passes with nothing in flight (a task of the coordinator)."""
        while True:
            delay = self.expires_at - self._clock()
            if self.resident and self.in_flight == 0 and delay <= 0:
                await self._unload_if_expired()
            self._changed.clear()
            wait = None if not self.resident or self.in_flight or math.isinf(delay) else max(delay, 0.0)
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except asyncio.TimeoutError:
                pass

    async def _unload_if_expired(self) -> None:
        async with self._switch:
            if self.resident and self.in_flight == 0 and self._clock() >= self.expires_at:
                self.resident = False  # before the calls: a request arriving now waits to load
                if self.on_expire is not None:
                    self.on_expire()
                else:
                    await self._set_all(False)

    async def _set_all(self, resident: bool) -> None:
        """SetResident on every live worker at once. A load must reach at least one decode
        worker (else NoWorkers); a worker that is gone is marked dead."""
        workers = self.registry.live()
        results = await asyncio.gather(*(self._call(w, resident) for w in workers),
                                       return_exceptions=True)
        ok_decode = False
        for worker, result in zip(workers, results):
            if isinstance(result, BaseException):
                log.warning("SetResident(%s) on %s failed: %s", resident, worker.worker_id, result)
                if isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_dead(worker.worker_id, f"SetResident: {result.details()}")
            elif worker.role in DECODE_ROLES:
                ok_decode = True
        log.info("model %s on %d worker(s)", "loaded" if resident else "unloaded", len(workers))
        if resident and not ok_decode:
            raise NoWorkers("no decode worker could load the model; retry once workers are up")

    async def _call(self, worker: WorkerRecord, resident: bool) -> pb.ResidencyResult:
        stub = worker.prefill_stub or worker.decode_stub
        return await stub.SetResident(pb.ResidencyRequest(resident=resident),
                                      timeout=self.rpc_timeout_s)
