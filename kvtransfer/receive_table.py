r"""A receiver's state machine, shared by every backend: grants, what has arrived, the one path
by which bytes reach the cache, revocations, deadlines, dead senders, and when a transfer's
blocks are free again.

Threads: `expect`, `poll` (which also fails transfers past their deadline), `cancel` and
`stats` run on the engine thread, entered through TableReceiver (receiver.py); everything else
on the backend's I/O thread (receiver_hooks.py lists what a backend calls). One lock guards
the table, so it stays one class: splitting it by thread would split that lock. Two-sided
backends (fake, zmq, grpc, dist) write into the cache here, under the lock, so once `cancel`
(or the poll that reports FAILED) has taken the lock no write for that transfer is in progress
or can start: RELEASED follows at once. Into a host cache the checksum is computed in the
same pass as the write (kernels/copy_crc32c.py: the received bytes are read once), so a unit
whose bytes do not match its header lands only in blocks granted to its own transfer, which
fails at once: nothing reads those blocks before RELEASED hands them back for rewriting. Into
a device cache the checksum comes first, outside the lock, and such a unit never reaches the
cache. RELEASED is the only way blocks go back: the engine's scheduler frees them when it
polls it, never on a timer.

Per transfer:

    ask (sender) ----------------------------------.
    expect() --> active --(ask, now or earlier)--> granted: Grant(skip, block ids) to the asker
                   |  |                               |  a second asker: refused
                   |  |  (all layers x blocks + finish)--> COMPLETE(first_token)
                   |  \--(refused unit, sender abort, deadline, cancel)--.
                   |                                                     v
                   |             two-sided, or never granted, or the sender already stopped
                   |             (its finish/abort/goodbye arrived) --> RELEASED at once
                   |             shm, sender may still write --> revoking: Revoke to the sender;
                   |                 its "revoked" (sent by its writer thread after its last
                   |                 write), an abort, a goodbye, or its process gone (fence)
                   |                 --> RELEASED
    FAILED is reported for refusals, aborts and deadlines; cancel() reports only RELEASED.

Block ids of active and revoking transfers are held: expect() refuses to hand them out again.
`closed` remembers recent outcomes (bounded) so a late unit or ask gets a precise refusal.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.copy_crc32c import copy_crc32c, stream_copies

from .auth import KVAuth
from .base import ReceiveEvent, ReceiveKind, TransferStats
from .fence import process_start_time, same_process_alive
from .layout import KVCacheBuffer, KVLayout
from .message import (
    Ack, Grant, HandshakeRequest, KVHeader, MessageError, Revoke, block_runs, buffer_address,
    checksum, checksum_blocks, payload_segments, payload_tensor,
)
from .stats import StatsCounter
from .transfer import IncomingTransfer

CLOSED_MEMORY = 4096  # finished transfer ids remembered for late units and asks
PENDING_MEMORY = 4096  # asks and early aborts remembered for transfers not yet expected

# deliver(sender_id, message): a Grant or a Revoke for that sender, sent by the backend.
Deliver = Callable[[str, "Grant | Revoke"], None]


@dataclass(frozen=True)
class _SenderInfo:
    pid: int
    start_time: int
    fenceable: bool  # its (pid, start time) is visible here, so death can be observed


class ReceiveTable:
    def __init__(
        self,
        cache: KVCacheBuffer,
        layout: KVLayout,
        deliver: Deliver,
        backend: str,
        one_sided: bool = False,
        on_claim: Callable[[str, tuple[int, ...]], None] | None = None,
        on_release: Callable[[tuple[int, ...]], None] | None = None,
        verify_in_place: bool = True,
        auth: KVAuth | None = None,
    ) -> None:
        if cache.layout != layout:
            raise ValueError(f"cache layout differs from receiver layout: {cache.layout.diff(layout)}")
        self.cache = cache
        self.layout = layout
        self.one_sided = one_sided  # the sender writes into the cache itself (shm)
        # one_sided: checksum the blocks in place (else the sender verified its own copy)
        self.verify_in_place = verify_in_place
        # Received bytes go into a host cache by address (checksummed in the same pass).
        self._host_cache = cache.tensor.device.type == "cpu" and cache.tensor.is_contiguous()
        self._deliver = deliver
        # With credentials, every unit and grant request must carry its transfer's token;
        # one that does not is dropped and counted, and fails nothing (a rogue must not be
        # able to fail a live transfer by naming it).
        self.auth = auth
        self.last_rejected = ""
        self._on_claim = on_claim  # shm: publish block ownership to senders
        self._on_release = on_release
        self._lock = threading.Lock()
        self._active: dict[str, IncomingTransfer] = {}
        self._revoking: dict[str, IncomingTransfer] = {}
        self._asks: OrderedDict[str, str] = OrderedDict()  # transfer id -> asking sender id
        self._early: OrderedDict[str, str] = OrderedDict()  # aborted before expect(): reason
        self._closed: OrderedDict[str, str] = OrderedDict()  # transfer id -> outcome
        self._senders: dict[str, _SenderInfo] = {}
        self._events: list[ReceiveEvent] = []
        self._stats = StatsCounter(backend)
        self.undecodable = 0  # messages dropped for want of a readable header (a metric)
        self.last_undecodable = ""

    # -- engine thread ----------------------------------------------------------------------

    def expect(
        self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float,
        skip_blocks: int = 0,
    ) -> None:
        exp = IncomingTransfer.expected(transfer_id, block_ids, num_layers, deadline_s, skip_blocks,
                                        self.cache.num_blocks, self.layout.num_layers)
        with self._lock:
            if transfer_id in self._active:
                raise ValueError(f"{transfer_id}: already expected")
            if transfer_id in self._revoking:
                raise ValueError(f"{transfer_id}: still being released (wait for RELEASED)")
            for other_id, other in (*self._active.items(), *self._revoking.items()):
                if exp.block_set & other.block_set:
                    state = "expected" if other_id in self._active else "not yet released"
                    raise ValueError(
                        f"{transfer_id}: blocks {sorted(exp.block_set & other.block_set)} {state} by {other_id}"
                    )
            self._closed.pop(transfer_id, None)
            self._active[transfer_id] = exp
            if self._on_claim is not None:
                self._on_claim(transfer_id, exp.block_ids)
            if transfer_id in self._early:
                exp.sender_stopped = True
                self._close(exp, ReceiveKind.FAILED, f"sender aborted: {self._early.pop(transfer_id)}")
            elif transfer_id in self._asks:
                self._grant(exp, self._asks.pop(transfer_id))

    def poll(self) -> list[ReceiveEvent]:
        now = time.monotonic()
        with self._lock:
            for exp in list(self._active.values()):
                if now > exp.deadline:
                    done = sum(1 for m in exp.missing if not m)
                    self._close(exp, ReceiveKind.FAILED,
                                f"deadline passed with {done}/{len(exp.missing)} layers complete"
                                + ("" if exp.grantee else " (no sender asked for it)"))
            events, self._events = self._events, []
        return events

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            exp = self._active.get(transfer_id)
            if exp is not None:
                self._close(exp, None, "cancelled")

    def stats(self) -> TransferStats:
        return self._stats.snapshot()

    # -- I/O thread: control ----------------------------------------------------------------

    def register_sender(self, request: HandshakeRequest) -> None:
        """A sender's handshake: remember its process for the fence."""
        start = process_start_time(request.pid) if request.pid > 0 else None
        fenceable = start is not None and request.start_time != 0 and start == request.start_time
        with self._lock:
            self._senders[request.sender_id] = _SenderInfo(request.pid, request.start_time, fenceable)

    def authentic(self, transfer_id: str, token: bytes, what: str) -> bool:
        """Whether `token` is transfer_id's; else counts the refusal (any thread)."""
        if self.auth is None or self.auth.token_ok(transfer_id, token):
            return True
        self._stats.add(auth_rejected=1)
        self.last_rejected = f"{what} for {transfer_id[:64]!r} with a {'wrong' if token else 'missing'} token"
        return False

    def count_rejected(self, reason: str) -> None:
        """A peer refused before any message (failed CURVE handshake)."""
        self._stats.add(auth_rejected=1)
        self.last_rejected = reason

    def ask(self, sender_id: str, transfer_id: str, token: bytes = b"") -> None:
        """A sender asks for transfer_id's grant; answered through deliver(), now or at expect().
        An unauthenticated ask is dropped without an answer: its sender id may be a real
        sender's, which a refusal would reach."""
        if not self.authentic(transfer_id, token, "grant request"):
            return
        with self._lock:
            exp = self._active.get(transfer_id)
            if exp is not None:
                if not exp.grantee or exp.grantee == sender_id:  # a repeat is answered again
                    self._grant(exp, sender_id)
                else:
                    self._refuse(sender_id, transfer_id, "already granted to another sender")
            elif transfer_id in self._revoking or transfer_id in self._closed:
                outcome = self._closed.get(transfer_id, "cancelled")
                self._refuse(sender_id, transfer_id, f"transfer {transfer_id} already {outcome}")
            elif transfer_id in self._early:
                self._refuse(sender_id, transfer_id, f"transfer {transfer_id} was aborted")
            elif self._asks.get(transfer_id, sender_id) != sender_id:
                self._refuse(sender_id, transfer_id, "another sender already asked for it")
            else:
                _bounded_put(self._asks, transfer_id, sender_id, PENDING_MEMORY)

    def withdraw(self, sender_id: str, transfer_id: str) -> None:
        """A pending ask whose sender stopped waiting (gRPC long poll expired)."""
        with self._lock:
            if self._asks.get(transfer_id) == sender_id:
                del self._asks[transfer_id]

    def control(self, header: KVHeader) -> Ack | None:
        """A finish unit (acked) or an abort unit (not acked)."""
        rid, sender = header.transfer_id, header.sender_id
        if not self.authentic(rid, header.auth_token, "abort" if header.is_abort else "finish"):
            return None if header.is_abort else self._nack(header, "unauthenticated unit dropped")
        with self._lock:
            exp = self._active.get(rid)
            if header.is_abort:
                reason = f"sender aborted: {header.sender_error}"
                if exp is not None and exp.grantee in ("", sender):
                    exp.sender_stopped = True
                    self._close(exp, ReceiveKind.FAILED, reason)
                elif rid in self._revoking and self._revoking[rid].grantee == sender:
                    self._release(self._revoking.pop(rid))  # it stopped: no write follows
                elif exp is None and rid not in self._closed and self._asks.get(rid, sender) == sender:
                    self._asks.pop(rid, None)
                    _bounded_put(self._early, rid, header.sender_error, PENDING_MEMORY)
                return None
            if exp is None:
                return self._nack(header, self._unknown(rid))
            if exp.grantee != sender:
                return self._nack(header, f"transfer {rid} is not granted to this sender")
            exp.finished, exp.first_token, exp.finish_units = True, header.first_token, header.num_units
            exp.sender_stopped = True
            self._maybe_complete(exp)
        return Ack(header.seq, rid, 0, True)

    def revoked(self, sender_id: str, transfer_id: str) -> None:
        """The sender's writer thread acknowledged a revocation: it writes nothing more."""
        with self._lock:
            exp = self._revoking.get(transfer_id)
            if exp is not None and exp.grantee == sender_id:
                self._release(self._revoking.pop(transfer_id))

    def sender_gone(self, sender_id: str, reason: str) -> None:
        """The sender closed (its goodbye, sent after its last write) or its process died."""
        with self._lock:
            self._sender_gone(sender_id, reason)
            self._senders.pop(sender_id, None)

    def check_fences(self) -> None:
        """Release what dead sender processes held (shm; called periodically)."""
        with self._lock:
            holders = {e.grantee for e in (*self._active.values(), *self._revoking.values()) if e.grantee}
            for sender_id in holders:
                info = self._senders.get(sender_id)
                if info is not None and info.fenceable and not same_process_alive(info.pid, info.start_time):
                    self._sender_gone(sender_id, f"sender process {info.pid} is gone")

    def fail_silent(self, silent: Callable[[str], bool], reason: str) -> None:
        """Fails (then releases) the transfers granted to these silent senders, each told by a
        revocation that reaches it if its link heals; the senders stay known and may go on with
        new transfers. Only for receivers that do every write themselves (not one_sided):
        nothing can land in those blocks once their transfer is closed."""
        assert not self.one_sided, "a one-sided writer may still be writing"
        with self._lock:  # only granted transfers: an idle sender is silent by design
            for exp in [e for e in self._active.values() if e.grantee and silent(e.grantee)]:
                self._close(exp, ReceiveKind.FAILED, reason)

    def refuse_undecodable(self, reason: str) -> None:
        """A message with no usable header: nobody to blame, nothing to ack."""
        with self._lock:
            self.undecodable += 1
            self.last_undecodable = reason

    # -- I/O thread: data ---------------------------------------------------------------------

    def ingest(self, header: KVHeader, data: bytes | bytearray | memoryview | None) -> Ack:
        """Validate one data unit and write it into the cache; the returned Ack goes to the sender.

        data=None means the sender already wrote the blocks in place (shm): verify them instead.
        """
        if not self.authentic(header.transfer_id, header.auth_token, "data unit"):
            return self._nack(header, "unauthenticated unit dropped")
        with self._lock:
            refusal = self._admit(header)
        if refusal is not None:
            return self._nack(header, refusal)
        segments: list[memoryview] | None = None
        try:
            if data is None:
                actual = header.checksum
                if self.verify_in_place:
                    actual = 0
                    for layer in header.layers:
                        actual = checksum_blocks(self.cache.tensor[layer], header.block_ids, actual)
            else:
                segments = payload_segments(header, data)
                actual = header.checksum  # host cache: checked during the write, below
                if not self._host_cache:
                    actual = 0
                    for segment in segments:
                        actual = checksum(segment, actual)
        except MessageError as e:
            return self._refuse_unit(header, str(e))
        if actual != header.checksum:
            return self._refuse_unit(header, self._mismatch(header, actual))
        with self._lock:
            refusal = self._admit(header)  # cancelled or failed while we were checksumming?
            if refusal is not None:
                return self._nack(header, refusal)
            exp = self._active[header.transfer_id]
            if segments is not None:
                written = self._write(header, segments)
                if written is not None and written != header.checksum:
                    return self._nack(header, self._fail_locked(exp, self._mismatch(header, written)))
            exp.units += 1
            for layer in header.layers:
                missing = exp.missing[layer]
                before = len(missing)
                missing.difference_update(header.block_ids)
                exp.missing_count -= before - len(missing)
            self._stats.add(bytes=header.payload_nbytes, units=1)
            self._maybe_complete(exp)
        return Ack(header.seq, header.transfer_id, header.layer, True)

    # -- internals (lock held unless noted) ---------------------------------------------------

    @staticmethod
    def _mismatch(header: KVHeader, actual: int) -> str:
        return (f"checksum mismatch on layers {header.layer}-{header.layers[-1]}: "
                f"got {actual:#010x}, header says {header.checksum:#010x}")

    def _write(self, header: KVHeader, segments: list[memoryview]) -> int | None:
        """The payload (each layer's [2, n, ...] in turn, cut into `segments`) into the header's
        blocks of each of its layers. Into a host cache: one native pass that also returns the
        payload's crc32c (the caller compares it). Into a device cache: torch copies, None."""
        runs = list(block_runs(range(len(header.block_ids)), header.block_ids))
        if not self._host_cache:
            data = segments[0] if len(segments) == 1 else b"".join(segments)
            payload = payload_tensor(header, data)
            for i, layer in enumerate(header.layers):
                dst = self.cache.tensor[layer]
                for src, start, length in runs:
                    dst[:, start:start + length].copy_(payload[i, :, src:src + length])
            return None
        # Slot arithmetic: the cache is contiguous [layer, kv, block, ...], so block b of (layer,
        # kv) starts at ((layer * 2 + kv) * num_blocks + b) * block_bytes; header.check_against
        # (in _admit) bounded the layers and ids. The payload streams in the same (layer, kv,
        # run) order, so its crc32c is the one the sender computed.
        cache = self.cache.tensor
        block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        base, num_blocks = cache.data_ptr(), cache.shape[2]
        dst_ranges = [(base + ((layer * 2 + kv) * num_blocks + start) * block_bytes, length * block_bytes)
                      for layer in header.layers for kv in (0, 1) for _, start, length in runs]
        src_ranges = [(buffer_address(segment), segment.nbytes) for segment in segments]
        return copy_crc32c(stream_copies(dst_ranges, src_ranges), verify=False)

    def _grant(self, exp: IncomingTransfer, sender_id: str) -> None:
        if not exp.grantee:
            exp.grantee = sender_id
            self._stats.add(skipped_blocks=exp.skip_blocks)
        self._deliver(sender_id, Grant(exp.transfer_id, True, "", exp.skip_blocks, exp.block_ids,
                                       exp.num_layers))

    def _refuse(self, sender_id: str, transfer_id: str, reason: str) -> None:
        self._deliver(sender_id, Grant(transfer_id, False, reason))

    def _unknown(self, rid: str) -> str:
        if rid in self._closed:
            return f"transfer {rid} already {self._closed[rid]}"
        if rid in self._revoking:
            return f"transfer {rid} already cancelled"
        return f"unexpected transfer {rid}"

    def _admit(self, header: KVHeader) -> str | None:
        rid = header.transfer_id
        exp = self._active.get(rid)
        if exp is None:
            return self._unknown(rid)
        if exp.grantee != header.sender_id:
            return f"transfer {rid} is not granted to this sender"
        try:
            header.check_against(self.layout, self.cache.num_blocks)
        except MessageError as e:
            return self._fail_locked(exp, str(e))
        foreign = [b for b in header.block_ids if b not in exp.block_set]
        if foreign:
            return self._fail_locked(exp, f"blocks {foreign} are not granted to transfer {rid}")
        if header.layer >= exp.num_layers:
            return self._fail_locked(exp, f"layer {header.layer} beyond the {exp.num_layers} expected")
        return None

    def _maybe_complete(self, exp: IncomingTransfer) -> None:
        if not exp.finished:
            return
        if exp.missing_count == 0:
            self._close(exp, ReceiveKind.COMPLETE, "")
        elif exp.units >= exp.finish_units:  # every unit the sender sent is in: some never will be
            self._close(exp, ReceiveKind.FAILED,
                        f"sender finished with {exp.missing_count} block-layers missing")

    def _refuse_unit(self, header: KVHeader, reason: str) -> Ack:
        """Fail the transfer for a unit that passed admission but not the checks (no lock)."""
        with self._lock:
            exp = self._active.get(header.transfer_id)
            if exp is not None and exp.grantee == header.sender_id:
                self._fail_locked(exp, reason)
        return self._nack(header, reason)

    def _nack(self, header: KVHeader, reason: str) -> Ack:
        return Ack(header.seq, header.transfer_id, header.layer, False, reason)

    def _fail_locked(self, exp: IncomingTransfer, reason: str) -> str:
        self._close(exp, ReceiveKind.FAILED, reason)
        return reason

    def _close(self, exp: IncomingTransfer, kind: ReceiveKind | None, reason: str) -> None:
        rid = exp.transfer_id
        del self._active[rid]
        if self._on_release is not None:
            self._on_release(exp.block_ids)  # shm: owner checks fail from here on
        elapsed = time.monotonic() - exp.started
        if kind is ReceiveKind.COMPLETE:
            self._events.append(ReceiveEvent(rid, kind, first_token=exp.first_token))
            self._remember(rid, "complete")
            self._stats.add(transfers_done=1, seconds=elapsed)
            return
        if kind is ReceiveKind.FAILED:
            self._events.append(ReceiveEvent(rid, kind, reason))
            self._stats.add(transfers_failed=1, seconds=elapsed)
        self._remember(rid, "cancelled" if kind is None else f"failed: {reason}")
        if exp.grantee and not exp.sender_stopped:
            self._deliver(exp.grantee, Revoke(rid, reason))
            if self.one_sided:  # it may be writing right now: wait for its word
                self._revoking[rid] = exp
                return
        self._release(exp)

    def _release(self, exp: IncomingTransfer) -> None:
        self._events.append(ReceiveEvent(exp.transfer_id, ReceiveKind.RELEASED))

    def _sender_gone(self, sender_id: str, reason: str) -> None:
        for exp in [e for e in self._active.values() if e.grantee == sender_id]:
            exp.sender_stopped = True
            self._close(exp, ReceiveKind.FAILED, reason)
        for rid in [r for r, e in self._revoking.items() if e.grantee == sender_id]:
            self._release(self._revoking.pop(rid))
        for rid in [r for r, s in self._asks.items() if s == sender_id]:
            del self._asks[rid]

    def _remember(self, rid: str, outcome: str) -> None:
        _bounded_put(self._closed, rid, outcome, CLOSED_MEMORY)


def _bounded_put(d: OrderedDict[str, str], key: str, value: str, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)
