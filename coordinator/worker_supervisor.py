"""The coordinator's side of the channel to the launcher that supervises its workers
(common/supervisor_wire.py): start a model's workers, ask whether any of them exited, stop
them. `WorkerSupervisor` is the interface coordinator/on_demand.py needs; `SupervisorChannel`
is it over the socket `tandem serve` hands this process. Tests give another implementation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
from pathlib import Path
from typing import Protocol

from common.supervisor_wire import (
    ENV_FD, MAX_LINE, Request, SupervisorError, WorkerExit, encode, exits_from,
)

log = logging.getLogger(__name__)


class WorkerSupervisor(Protocol):
    async def open(self) -> None:
        """Ready the channel (on the serving event loop)."""

    async def close(self) -> None: ...

    async def start(self, model: str, path: Path) -> list[str]:
        """Start the model's workers (they register by themselves); their worker ids."""

    async def exits(self, model: str) -> list[WorkerExit]:
        """Exits of the model's workers since its start."""

    async def stop(self, model: str) -> list[str]:
        """Stop its workers and wait until they are gone; how each ended, and freed memory."""


def channel_fd(env=None) -> int | None:
    """The channel's descriptor a launcher gave this process, if any."""
    value = (os.environ if env is None else env).get(ENV_FD, "").strip()
    return int(value) if value.isdigit() else None


class SupervisorChannel:
    """WorkerSupervisor over the socket of `fd`; `open()` on the serving event loop first."""

    def __init__(self, fd: int, stop_timeout_s: float = 60.0) -> None:
        self._fd = fd
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._stop_timeout_s = stop_timeout_s
        self._closed: str | None = None  # why the channel is gone

    async def open(self) -> None:
        sock = socket.socket(fileno=self._fd)
        reader, self._writer = await asyncio.open_connection(sock=sock, limit=MAX_LINE)
        self._reader_task = asyncio.create_task(self._read(reader))

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._writer is not None:
            self._writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                reply = json.loads(line)
                future = self._pending.pop(int(reply.get("id", -1)), None)
                if future is not None and not future.done():
                    future.set_result(reply)
            self._closed = "the launcher closed the supervisor channel"
        except (OSError, ValueError) as exc:
            self._closed = f"the supervisor channel failed: {exc}"
        log.warning("%s: models can no longer be loaded on request", self._closed)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SupervisorError(self._closed))
        self._pending.clear()

    async def _call(self, op: str, model: str, path: str = "", timeout: float = 30.0) -> dict:
        if self._closed or self._writer is None:
            raise SupervisorError(self._closed or "the supervisor channel is not open")
        request = Request(next(self._ids), op, model, path)
        future = asyncio.get_running_loop().create_future()
        self._pending[request.id] = future
        try:
            self._writer.write(encode(request))
            await self._writer.drain()
            # Shielded: a caller that gives up (its client left) leaves the reply to be read.
            reply = await asyncio.wait_for(asyncio.shield(future), timeout)
        finally:
            if future.done() or future.cancelled():
                self._pending.pop(request.id, None)
        if "error" in reply:
            raise SupervisorError(str(reply["error"]))
        return reply

    async def start(self, model: str, path: Path) -> list[str]:
        return [str(w) for w in (await self._call("start", model, str(path)))["workers"]]

    async def exits(self, model: str) -> list[WorkerExit]:
        return exits_from(await self._call("status", model))

    async def stop(self, model: str) -> list[str]:
        reply = await self._call("stop", model, timeout=self._stop_timeout_s)
        return [*map(str, reply.get("stopped", ())),
                *(f"freed shared memory {n}" for n in reply.get("freed", ()))]
