"""The sender shared by every backend, as the prefill engine sees it: the KVSender contract
(kvtransfer/base.py) on the engine thread. It only validates and enqueues: the I/O thread
(sender_io.SendLoop) does every network call, gather and checksum, and a backend adds only its
transport (sender_hooks.SenderHooks).

    engine thread (this module)        I/O thread (sender_io.SendLoop.run)
    send/finish/abort --> inbox -+-->  ask for the grant (first unit of a transfer)
                          waker  |     wait: grant | ack | revocation | deadline | inbox
    poll <-- result (lock) <-----+--   gather source[:, src ids] (blocks >= skip_blocks only,
                                       block index -> destination id from the grant),
                                       checksum, transmit; DONE when finish and every unit
                                       are acknowledged; FAILED on a refusal, a deadline,
                                       a revocation or a dead peer

    thread    calls                                 blocks on
    engine    connect (once), send, finish, abort,  connect: the handshake, <= connect_timeout_s;
              poll (every step), close (once)       the rest: the sender's lock only
    any       stats, failed_peer

Invariants:
- A transfer enters the table at its first send/finish/abort and leaves it when poll()
  reports its terminal status, which the I/O thread publishes only after it dropped every
  queued unit: the caller may free the source blocks then, and only the caller's scheduler
  frees them, never this sender and never on a timer.
- Reported ids are remembered (bounded) so a late abort() of one is a no-op.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from .auth import KVAuth
from .base import KVSender, KVTransferError, TransferState, TransferStats, TransferStatus
from .layout import KVLayout
from .sender_hooks import SenderHooks
from .sender_io import SendLoop
from .stats import StatsCounter
from .transfer import FinishUnit, OutgoingTransfer, SendUnit
from .waker import Waker

REPORTED_MEMORY = 4096  # reported transfer ids remembered, so a late abort() is a no-op


class IOSender(KVSender, SenderHooks):
    """The engine-facing contract; it *has* an I/O thread (`io`, a SendLoop). A backend
    subclasses it and implements the SenderHooks."""

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 auth: KVAuth | None = None) -> None:
        if not ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s must be > 0, got {ack_timeout_s!r}")
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        self.ack_timeout_s = ack_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.auth = auth
        self.sender_id = uuid.uuid4().hex
        self.layout = None
        self.endpoint = ""
        self.closed = False
        self._lock = threading.Lock()
        self._transfers: dict[str, OutgoingTransfer] = {}  # not yet reported by poll()
        self._reported: OrderedDict[str, None] = OrderedDict()  # recent terminal ids (bounded)
        self._waker = Waker()
        self._stats = StatsCounter(self.backend)
        self.io = SendLoop(self, self.sender_id, ack_timeout_s, self._lock, self._stats, self._waker)

    # -- engine thread ------------------------------------------------------------------------

    def connect(self, endpoint: str, layout: KVLayout) -> None:
        if self.closed:
            raise KVTransferError("sender is closed")
        if self.io.thread is not None:
            raise KVTransferError(f"already connected to {self.endpoint}")
        self._handshake(endpoint, layout)
        self.layout, self.endpoint = layout, endpoint
        self.io.start(endpoint, layout)

    def send(
        self, transfer_id: str, layer: int, first_block: int, source: torch.Tensor,
        src_block_ids: Sequence[int],
    ) -> None:
        unit = self._check_send(transfer_id, layer, first_block, source, src_block_ids)
        self._enqueue(transfer_id, ("send", unit))

    def finish(self, transfer_id: str, first_token: int) -> None:
        self._check_transfer_id(transfer_id)
        if not isinstance(first_token, int) or isinstance(first_token, bool):
            raise ValueError(f"{transfer_id}: first_token must be an int, got {first_token!r}")
        self._enqueue(transfer_id, ("finish", FinishUnit(first_token)))

    def abort(self, transfer_id: str, reason: str) -> None:
        if self.closed:
            return  # close() already failed every open transfer
        self._check_transfer_id(transfer_id)
        with self._lock:
            if transfer_id in self._reported and transfer_id not in self._transfers:
                return  # already over and reported: nothing to abort
        self._enqueue(transfer_id, ("abort", reason or "aborted"))

    def poll(self, transfer_id: str) -> TransferStatus:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                raise KeyError(f"unknown transfer {transfer_id!r} (never sent, or already reported)")
            if t.result is None:
                return TransferStatus(TransferState.IN_FLIGHT)
            del self._transfers[transfer_id]
            self._reported[transfer_id] = None
            while len(self._reported) > REPORTED_MEMORY:
                self._reported.popitem(last=False)
            return t.result

    def stats(self) -> TransferStats:
        return self._stats.snapshot()

    @property
    def failed_peer(self) -> str:
        return self.io.failed_peer

    def close(self) -> None:
        """Stop the I/O thread (it fails what is open, says goodbye, closes the transport).
        Should the thread not stop in time (stuck in a transport call), open transfers are
        reported FAILED anyway: the caller is shutting down and frees everything regardless."""
        if self.closed:
            return
        self.closed = True
        self.io.stop(join_timeout_s=self.connect_timeout_s + 5.0)
        with self._lock:
            for t in self._transfers.values():
                if t.result is None:
                    t.result = TransferStatus(TransferState.FAILED, "sender closed")

    # -- engine thread internals -------------------------------------------------------------

    def _check_transfer_id(self, transfer_id: str) -> None:
        if self.closed:
            raise KVTransferError("sender is closed")
        if self.layout is None:
            raise KVTransferError("send() before connect()")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError(f"transfer_id must be a non-empty str, got {transfer_id!r}")

    def _check_send(
        self, transfer_id: str, layer: int, first_block: int, source: torch.Tensor,
        src_block_ids: Sequence[int],
    ) -> SendUnit:
        self._check_transfer_id(transfer_id)
        layout = self.layout
        assert layout is not None  # checked above
        if not 0 <= layer < layout.num_layers:
            raise ValueError(f"{transfer_id}: layer {layer} not in [0, {layout.num_layers})")
        if not isinstance(first_block, int) or first_block < 0:
            raise ValueError(f"{transfer_id}: first_block must be an int >= 0, got {first_block!r}")
        if not isinstance(source, torch.Tensor) or source.dtype != layout.torch_dtype:
            got = getattr(source, "dtype", type(source).__name__)
            raise ValueError(f"{transfer_id}: source dtype {got} != layout {layout.dtype}")
        if source.dim() != 5 or source.shape[0] != 2 or tuple(source.shape[2:]) != layout.block_shape():
            raise ValueError(
                f"{transfer_id}: source shape {list(source.shape)} is not one layer's cache "
                f"[2, num_blocks, {', '.join(map(str, layout.block_shape()))}]"
            )
        ids = tuple(map(int, src_block_ids))
        if not ids:
            raise ValueError(f"{transfer_id}: src_block_ids is empty")
        if min(ids) < 0 or max(ids) >= source.shape[1]:  # once per layer: the common case is cheap
            bad = [b for b in ids if not 0 <= b < source.shape[1]]
            raise ValueError(f"{transfer_id}: src block ids {bad} out of range [0, {source.shape[1]})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{transfer_id}: duplicate src block ids in {list(ids)}")
        return SendUnit(layer, first_block, source, ids)

    def _enqueue(self, transfer_id: str, command: tuple[Any, ...]) -> None:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                t = self._transfers[transfer_id] = OutgoingTransfer(transfer_id, time.monotonic())
            if t.result is not None:
                return  # already terminal, not yet polled: nothing more to do for it
            if not self.io.running:
                t.result = TransferStatus(TransferState.FAILED, self.io.failed_peer or "sender closed")
                return
        self.io.post((command[0], t, *command[1:]))
