"""An engine on its own thread, so that a worker's asyncio loop (gRPC, heartbeats, KV
transfers) never waits behind a forward pass.

Threading contract:
- Everything that touches the engine (scheduler, block manager, runner) runs on the engine
  thread. Other threads hand it work with `call(fn)`; `fn` runs between two steps, in order.
- The engine thread hands results back with `post(fn, *args)`, which schedules `fn` on the
  asyncio loop given at construction; nothing on the engine thread touches asyncio objects.
- Each iteration: run queued calls, `poll()` (subclasses: transfers), one `engine.step()` if
  any request has work, `on_outputs(...)`. With nothing to do it sleeps on the call queue for
  at most `idle_wait_s`, so polling continues while transfers are in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

from engine.llm_engine import LLMEngine, StepOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, name: str = "engine",
                 idle_wait_s: float = 0.002) -> None:
        self.engine = engine
        self.loop = loop
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(lambda: None)
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- engine thread -------------------------------------------------------------------

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the process is shutting down
            pass

    def poll(self) -> None:
        """Per-iteration hook for subclasses (KV transfer progress)."""

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        """Per-step hook for subclasses: deliver what the step produced."""

    def on_fatal(self, exc: BaseException) -> None:
        """The loop died on an internal error; subclasses fail every open request."""

    def _drain(self, block: bool) -> None:
        try:
            fn = self._calls.get(timeout=self.idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            fn()
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_work())
                self.poll()
                if self.engine.has_work():
                    outputs = self.engine.step()
                    self.steps += 1
                    if outputs:
                        self.on_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            log.exception("engine loop died")
            self.on_fatal(exc)
