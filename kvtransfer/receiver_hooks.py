"""What a receiver's transport backend implements: the small interface between the shared
receiver (receiver.py, engine thread; receive_table.py, the state) and one transport.

A backend, in its constructor, builds `table` (a ReceiveTable given its `_deliver`) and sets
`_endpoint`; it implements:

    _deliver(sender_id, msg)  called by the table, under the table's lock, on whichever thread
                              holds it (an ask or a unit on the I/O thread, expect/poll/cancel on
                              the engine thread): send a Grant or a Revoke to that sender. It
                              must not block and must not call back into the table.
    close()                   once, at shutdown (engine thread).

and on its own I/O thread hands what arrives to the table:

    register_sender (handshake), ask / withdraw (grant requests), control (finish, abort),
    ingest (data units; its Ack goes back to the sender), revoked (a revocation's answer),
    sender_gone (goodbye or a dead process), check_fences (periodically, one-sided backends),
    fail_silent (two-sided backends: a granted sender heard from no more), authentic /
    count_rejected / refuse_undecodable (refusals before a unit is read).

A backend never frees blocks and never reports events itself: the table reports RELEASED
when no writer remains, and the engine's scheduler frees the blocks then, never on a timer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .message import Grant, Revoke
from .receive_table import ReceiveTable


class ReceiverHooks(ABC):
    """A transport backend's half of a receiver."""

    table: ReceiveTable
    _endpoint: str

    @abstractmethod
    def _deliver(self, sender_id: str, message: Grant | Revoke) -> None:
        """Send a Grant or a Revoke to sender_id (called under the table's lock)."""
