"""The receiver shared by every backend, as the decode engine sees it: the KVReceiver
contract (kvtransfer/base.py) on the engine thread, each call a short critical section of the
backend's ReceiveTable (receive_table.py), none of which waits on the network. The backend adds
only its transport (receiver_hooks.ReceiverHooks) and close().

    thread    calls
    engine    expect (once per transfer), poll (every step), cancel (on abort), close (once)
    any       stats, endpoint

Invariant: a transfer's blocks are the engine's again only after poll() reported its COMPLETE
or its RELEASED; the engine's scheduler frees them then, never this receiver, never on a timer.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import KVReceiver, ReceiveEvent, TransferStats
from .receiver_hooks import ReceiverHooks


class TableReceiver(KVReceiver, ReceiverHooks):
    """A receiver whose bookkeeping is a ReceiveTable (`self.table`) and whose address is
    `self._endpoint`: the engine-facing half of the contract, shared by every backend."""

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def expect(
        self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float,
        skip_blocks: int = 0,
    ) -> None:
        self.table.expect(transfer_id, block_ids, num_layers, deadline_s, skip_blocks)

    def poll(self) -> list[ReceiveEvent]:
        return self.table.poll()

    def cancel(self, transfer_id: str) -> None:
        self.table.cancel(transfer_id)

    def stats(self) -> TransferStats:
        return self.table.stats()
