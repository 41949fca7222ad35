"""One connected KVSender per (backend, decode endpoint), made on first use.

connect() handshakes with the receiver and may block for its timeout, so it runs in a thread,
never on the event loop nor the engine thread; a layout mismatch surfaces here, before any
compute is spent on a request."""

from __future__ import annotations

import asyncio
import logging

import kvtransfer
from common.errors import TandemError

log = logging.getLogger(__name__)


class SenderPool:
    def __init__(self, layout: kvtransfer.KVLayout, ack_timeout_s: float = 30.0,
                 connect_timeout_s: float = 10.0, auth=None) -> None:
        self.layout = layout
        self.auth = auth  # kvtransfer.auth.KVAuth with a cluster secret, else None
        self.ack_timeout_s = ack_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._senders: dict[tuple[str, str], kvtransfer.KVSender] = {}
        # Evicted senders: transfers of theirs may still be draining on the engine thread
        # (their poll() turns FAILED), so they are closed at shutdown, not at eviction.
        self._retired: list[kvtransfer.KVSender] = []
        self._lock = asyncio.Lock()

    async def get(self, backend: str, endpoint: str) -> kvtransfer.KVSender:
        key = (backend, endpoint)
        async with self._lock:
            sender = self._senders.get(key)
            if sender is not None and not sender.failed_peer:
                return sender
            if sender is not None:
                # The receiver died or became unreachable: this connection is done for, and a
                # restarted decode worker at the same endpoint needs a fresh handshake.
                log.warning("evicting the KV sender to %s (%s): %s", endpoint, backend,
                            sender.failed_peer)
                del self._senders[key]
                self._retired.append(sender)
            try:
                sender = kvtransfer.create_sender(backend, ack_timeout_s=self.ack_timeout_s,
                                                  connect_timeout_s=self.connect_timeout_s,
                                                  **({"auth": self.auth} if self.auth else {}))
                await asyncio.to_thread(sender.connect, endpoint, self.layout)
            except kvtransfer.KVLayoutMismatch as exc:
                raise TandemError(f"KV layout of {endpoint} does not match this worker's: {exc}") from exc
            except (kvtransfer.KVTransferError, ValueError) as exc:
                raise TandemError(f"cannot reach KV receiver {endpoint} ({backend}): {exc}") from exc
            self._senders[key] = sender
            return sender

    def stats(self) -> list:
        """Every sender's counters, evicted ones included (the counters are monotonic)."""
        return [s.stats() for s in [*self._senders.values(), *self._retired]]

    def close(self) -> None:
        for sender in [*self._senders.values(), *self._retired]:
            sender.close()
        self._senders.clear()
        self._retired.clear()
