"""What a sender's transport backend implements: the small interface between the shared
sender (sender.py, engine thread; sender_io.py, I/O thread) and one transport.

    method            thread                       when, how often
    _handshake        engine, inside connect()     once; set up the transport, check layouts
    _io_wait          I/O                          every loop turn; block until woken, a message
                                                   arrives (hand it to self.io.on_*) or timeout
    _io_ask           I/O                          once per transfer (again after a "pending")
    _io_can_transmit  I/O                          before each queued unit: False holds it queued
                                                   (flow control; _io_next_due says when to look again)
    _io_unit_layers   I/O                          before each unit: how many queued layers may
                                                   travel in it (1: one unit per layer)
    _io_transmit      I/O                          once per granted unit; returns "" or an error
    _io_control       I/O                          a finish or abort unit
    _io_revoked       I/O                          after a revocation: nothing more is written
    _io_acked         I/O                          each ack, before the state machine reads it
    _io_peer_failed   I/O                          once the receiver is declared dead
    _io_ping          I/O                          heartbeat backends, while a transfer is open
    _io_tick          I/O                          every loop turn
    _io_next_due      I/O                          every loop turn: an extra wake-up time
    _io_close         I/O                          once, at the thread's exit: goodbye, close

Incoming messages reach the state machine through `self.io` (a SendLoop): on_grant, on_ack,
on_revoke and heard when the backend reads them on the I/O thread (zmq, dist, the fake), or
io.post(("grant" | "ack" | "fail" | "peer_dead", ...)) from another thread (gRPC callbacks).
No hook may block for long, free blocks or touch the engine's state: a transfer's terminal
status is published by the state machine only, and the engine's scheduler frees the blocks
after poll() reports it, never on a timer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels.copy_crc32c import copy_crc32c

from .auth import KVAuth
from .base import KVLayoutMismatch
from .fence import own_identity
from .layout import KVLayout
from .message import Ack, HandshakeRequest, KVHeader, block_runs, checksum
from .transfer import OutgoingTransfer
from .waker import Waker


class SenderHooks(ABC):
    """A transport backend's half of a sender. The attributes are set by IOSender (sender.py)
    and only read here and by the backend."""

    backend = "?"
    heartbeat = False  # the transport answers _io_ping(): silence then means a dead peer

    sender_id: str
    auth: KVAuth | None  # with one, every header and grant request carries the transfer's token
    ack_timeout_s: float
    connect_timeout_s: float
    layout: KVLayout | None  # set by connect(), after _handshake
    endpoint: str
    _waker: Waker  # the I/O thread's wake-up pipe: a backend's poller may wait on its fd

    # -- engine thread ----------------------------------------------------------------------

    @abstractmethod
    def _handshake(self, endpoint: str, layout: KVLayout) -> None:
        """Engine thread, in connect(): set up the transport, check the layouts (raise on a
        mismatch). Blocks for at most connect_timeout_s."""

    def _handshake_request(self, layout: KVLayout) -> HandshakeRequest:
        pid, start = own_identity()
        return HandshakeRequest(layout, self.sender_id, pid, start)

    def _check_layout(self, ours: KVLayout, theirs: KVLayout, endpoint: str) -> None:
        if ours.fingerprint != theirs.fingerprint:
            diff = "; ".join(ours.diff(theirs))
            raise KVLayoutMismatch(f"receiver at {endpoint} has another KV layout (ours != theirs): {diff}")

    # -- I/O thread: the transport ------------------------------------------------------------

    def _io_wait(self, timeout: float) -> None:
        """Block until the waker fires, a transport message arrives (dispatch it to io.on_*) or
        `timeout` passes."""
        self._waker.wait(timeout)

    @abstractmethod
    def _io_ask(self, t: OutgoingTransfer) -> None:
        """Ask the receiver for t's grant."""

    def _io_can_transmit(self) -> bool:
        """Whether the transport takes another unit now (zmq: a free staging buffer)."""
        return True

    def _io_unit_layers(self, layer_nbytes: int) -> int:
        """How many consecutive layers of `layer_nbytes` payload bytes each one data unit may
        carry: what the receiver said it takes, within what the transport holds at once."""
        return 1

    @abstractmethod
    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        """Move sources[i][:, src_ids] into the receiver's blocks dst_ids of layer `layer + i`
        for each i, as unit `seq` (one header, its ack arrives later through io.on_ack;
        len(sources) <= _io_unit_layers). Returns "" or why the transfer must fail."""

    @abstractmethod
    def _io_control(self, t: OutgoingTransfer, header: KVHeader) -> None:
        """Send a finish or abort unit."""

    def _io_revoked(self, transfer_id: str) -> None:
        """Tell the receiver this thread writes nothing more for transfer_id."""

    def _io_acked(self, ack: Ack) -> None:
        """An ack arrived for unit ack.seq: release what the transport held for it (dist)."""

    def _io_peer_failed(self, reason: str) -> None:
        """The receiver is declared dead or unreachable: drop what the transport holds (dist)."""

    def _io_ping(self) -> None:
        """Ask for any reply (heartbeat backends only)."""

    def _io_tick(self, now: float) -> None:
        """Once per loop iteration (the fake delivers delayed units here)."""

    def _io_next_due(self) -> float | None:
        """A monotonic time the loop must wake at, besides the deadlines."""
        return None

    def _io_close(self) -> None:
        """At I/O thread exit: say goodbye, close the transport."""

    # -- helpers for backends (I/O thread) ----------------------------------------------------

    def gather(self, source: torch.Tensor, src_ids: tuple[int, ...]) -> torch.Tensor:
        """source[:, src_ids] as a fresh contiguous CPU tensor (the payload)."""
        idx = torch.tensor(src_ids, dtype=torch.long, device=source.device)
        return source.index_select(1, idx).cpu().contiguous()

    def gather_crc(self, sources: tuple[torch.Tensor, ...], src_ids: tuple[int, ...],
                   out: torch.Tensor) -> int:
        """Each source's [:, src_ids] in turn into the first bytes of `out` (contiguous, CPU, at
        least the payload's size) and the payload's crc32c, in one native pass
        (kernels/copy_crc32c.py: each word is read once for both). The receiver checks that crc
        against what it got, so the staging copy itself is covered end to end."""
        count = len(src_ids)
        if any(s.device.type != "cpu" or not s.is_contiguous() for s in sources):
            # rare: a source the runs cannot slice
            payload = torch.cat([self.gather(s, src_ids).view(-1).view(torch.uint8) for s in sources])
            out[:payload.numel()].copy_(payload)
            return checksum(payload)
        itemsize = sources[0].element_size()
        block_bytes = sources[0][0, 0].numel() * itemsize
        if out.device.type != "cpu" or not out.is_contiguous() or \
                out.numel() * out.element_size() < len(sources) * 2 * count * block_bytes:
            raise ValueError("gather_crc needs a contiguous CPU buffer of the payload's size")
        runs = list(block_runs(src_ids, range(count)))
        copies = []
        dst_base = out.data_ptr()
        for source in sources:  # each layer's [2, count, ...]: every K block, then every V block
            for kv in (0, 1):
                src_base = source.data_ptr() + kv * source.stride(0) * itemsize
                copies += [(dst_base + dst * block_bytes, src_base + src * block_bytes, length * block_bytes)
                           for src, dst, length in runs]
                dst_base += count * block_bytes
        return copy_crc32c(copies, verify=False)

    def data_header(
        self, t: OutgoingTransfer, layer: int, dst_ids: tuple[int, ...], payload: torch.Tensor | None,
        seq: int, crc: int | None = None, layer_count: int = 1,
    ) -> KVHeader:
        assert self.layout is not None
        return KVHeader.for_payload(t.transfer_id, layer, dst_ids, payload, self.layout, seq,
                                    sender_id=self.sender_id, crc=crc,
                                    auth_token=self.token(t.transfer_id), layer_count=layer_count)

    def token(self, transfer_id: str) -> bytes:
        """The transfer's token (kvtransfer/auth.py), b"" without credentials."""
        return b"" if self.auth is None else self.auth.token(transfer_id)
