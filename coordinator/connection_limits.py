"""How long an HTTP connection may hold a socket without a request, and how many one client
address may hold: uvicorn's h11 protocol with timers and counts (issue 26).

uvicorn closes a connection idle between two requests (`timeout_keep_alive`, our
`idle_timeout_s`) but waits forever for a request head or body that never ends, so sockets
that send nothing, half a header or half a body used every file descriptor. `LimitedH11`
watches each connection's request side (h11's `their_state`) after every read and response:

    connected ─> IDLE ── head complete ──> SEND_BODY ── body complete ──> DONE ─> (response)
                 │ head timer:              │ body timer: re-armed on             │
                 │ the whole head within    │ each read; fires after              └─> IDLE again
                 │ header_timeout_s         │ body_timeout_s of silence                 (keep-alive)
                 └─ fires: close            └─ fires: close (the app sees a disconnect: 499)

A body timer that fires while uvicorn itself paused reading (the app has not read what came)
waits again: the silence is ours, not the client's. While a response streams (DONE) no timer
runs: a long generation is not idleness.

The limits are CoordinatorConfig's header_timeout_s, body_timeout_s, max_connections and
max_connections_per_client. Counts: a connection beyond `max_connections` in all, or beyond `max_connections_per_client`
from one client address, is answered at once with a 503 in Ollama's shape (the request was not
read, so its API is unknown) and closed, with a warning in the log (at most one a second, with
the number refused since). Each server gets its own counts: `protocol_for(config)` makes a
class per uvicorn.Config.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from coordinator.config import CoordinatorConfig

log = logging.getLogger(__name__)


class _Refusals:
    """Counts refused connections; logs at most one line a second."""

    def __init__(self) -> None:
        self.unlogged, self.logged_at = 0, float("-inf")

    def note(self, why: str) -> None:
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= 1.0:
            log.warning("refused %d HTTP connection(s) with a 503 since the last such line: %s",
                        self.unlogged, why)
            self.unlogged, self.logged_at = 0, now


class LimitedH11(H11Protocol):
    limits: CoordinatorConfig  # set by protocol_for, with the counts below
    open_by_client: Counter
    refusals: _Refusals

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_state: object = None  # the h11 state it waits in (IDLE, SEND_BODY)
        self._counted = None
        address = self.client[0] if self.client else "?"
        limits = self.limits
        if len(self.connections) > limits.max_connections:
            self._refuse(f"{limits.max_connections} connections are open (max_connections)")
        elif self.open_by_client[address] >= limits.max_connections_per_client:
            self._refuse(f"client {address} holds {limits.max_connections_per_client} "
                         "connections (max_connections_per_client)")
        else:
            self.open_by_client[address] += 1
            self._counted = address
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._counted is not None:
            self.open_by_client[self._counted] -= 1
            if self.open_by_client[self._counted] <= 0:
                del self.open_by_client[self._counted]
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    # ---- timers ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Arms the timer the request side's state calls for (see the module docstring)."""
        if self.transport.is_closing():
            self._stop_timer()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._timer_state is not h11.IDLE:  # the whole head, from when it was awaited
                self._start_timer(state, self.limits.header_timeout_s)
        elif state is h11.SEND_BODY:
            self._start_timer(state, self.limits.body_timeout_s)  # silence since the last read
        else:
            self._stop_timer()

    def _start_timer(self, state, seconds: float) -> None:
        self._stop_timer()
        self._timer_state = state
        self._timer = self.loop.call_later(seconds, self._expired)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_state = None, None

    def _expired(self) -> None:
        state, self._timer, self._timer_state = self._timer_state, None, None
        if self.transport.is_closing() or self.conn.their_state is not state:
            return
        if state is h11.SEND_BODY and self.flow.read_paused:
            self._watch()  # uvicorn stopped reading: the wait is the app's, not the client's
            return
        what = ("a complete request head" if state is h11.IDLE
                else f"more of the request body of {self.scope['method']} {self.scope['path']}")
        seconds = (self.limits.header_timeout_s if state is h11.IDLE
                   else self.limits.body_timeout_s)
        log.debug("closing the connection of %s: no %s within %g s", self.client, what, seconds)
        self.transport.close()

    # ---- refusal --------------------------------------------------------------------------------

    def _refuse(self, why: str) -> None:
        self.refusals.note(why)
        body = json.dumps({"error": f"server busy: {why}; try again later"}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: {self.limits.retry_after_s}\r\n"
                "connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()


def protocol_for(limits: CoordinatorConfig) -> type[LimitedH11]:
    """A LimitedH11 class with its own counts, for one uvicorn.Config(http=...); `limits`: the
    header/body timeouts, connection counts and retry_after_s of the config."""
    return type("LimitedH11", (LimitedH11,), {"limits": limits, "open_by_client": Counter(),
                                              "refusals": _Refusals()})
