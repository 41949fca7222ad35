"""The sender half shared by every backend: the engine thread only enqueues, one I/O thread per
sender does the rest.

    engine thread                      I/O thread (one per sender, owns the transport)
    send/finish/abort --> inbox -+-->  ask for the grant (first unit of a transfer)
                          waker  |     wait: grant | ack | revocation | deadline | inbox
    poll <-- result (lock) <-----+--   gather source[:, src ids] (blocks >= skip_blocks only,
                                       block index -> destination id from the grant),
                                       checksum, transmit; DONE when finish and every unit
                                       are acknowledged; FAILED on a refusal, a deadline,
                                       a revocation or a dead peer

Per transfer, on the I/O thread:

    queued --(grant)--> transmitting --(finish acked, no unit in flight)--> DONE
       |                    |
       +--------------------+--(refused grant/unit, no grant or ack within ack_timeout_s,
                                 revoke, abort(), dead peer, close())--> FAILED

A terminal status is published only after the I/O thread dropped every queued unit of the
transfer, so it never reads the caller's `source` again: the caller may free the blocks as soon
as poll() says so. On a failure it did not hear from the receiver (deadline, abort(), owner
table) the I/O thread tells the receiver with an abort unit, which lets a receiver waiting for
a revocation release the blocks at once.

A backend provides the transport: _handshake (engine thread, in connect), and on the I/O
thread _io_wait, _io_ask, _io_transmit, _io_control, and optionally _io_revoked, _io_ping,
_io_tick, _io_close. Its incoming messages reach the state through the _on_* methods, called
on the I/O thread (zmq reads its socket there) or posted into the inbox by _post (gRPC and the
fake receive on other threads).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
import uuid
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .auth import KVAuth
from .base import (
    KVLayoutMismatch, KVSender, KVTransferError, TransferState, TransferStats, TransferStatus,
)
from .fence import own_identity
from .layout import KVLayout
from .message import Ack, Grant, HandshakeRequest, KVHeader, Revoke

log = logging.getLogger(__name__)

MAX_WAIT_S = 0.5  # the I/O thread wakes at least this often (closing, pings)
REPORTED_MEMORY = 4096  # reported transfer ids remembered, so a late abort() is a no-op


class Waker:
    """A self-pipe: any thread writes a byte, the I/O thread's select/zmq.Poller wakes on `fd`."""

    def __init__(self) -> None:
        self.fd, self._wfd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._wfd, False)

    def wake(self) -> None:
        try:
            os.write(self._wfd, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (already awake) or closed (shutting down)

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float) -> None:
        select.select([self.fd], [], [], max(timeout, 0.0))
        self.drain()

    def close(self) -> None:
        for fd in (self.fd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass


class StatsCounter:
    """Thread-safe monotonic counters behind TransferStats."""

    def __init__(self, backend: str) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats(backend)

    def add(self, **deltas: float) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})

    def snapshot(self) -> TransferStats:
        with self._lock:
            return self._stats


@dataclass
class _Unit:
    layer: int
    first_block: int  # block index (position in the request) of src_block_ids[0]
    source: torch.Tensor  # the caller's layer cache [2, num_blocks, block_size, heads, head_dim]
    src_block_ids: tuple[int, ...]


@dataclass
class _Finish:
    first_token: int


@dataclass(eq=False)
class _Transfer:
    transfer_id: str
    started: float  # first send/finish/abort, time.monotonic()
    result: TransferStatus | None = None  # terminal status; under the sender's lock
    # -- I/O thread only ----------------------------------------------------------------------
    queue: deque[_Unit | _Finish] = field(default_factory=deque)  # waiting for grant/transmit
    asked_at: float | None = None
    grant: Grant | None = None
    sent: list[set[int]] = field(default_factory=list)  # per layer, block indices sent
    units_sent: int = 0
    inflight: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline
    layers: dict[int, int] = field(default_factory=dict)  # seq -> layer, for messages
    finish_seq: int = 0
    finish_acked: bool = False


class IOSender(KVSender):
    """The engine-facing contract and the I/O thread; subclasses add a transport."""

    backend = "?"
    heartbeat = False  # the transport answers _io_ping(): silence then means a dead peer

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 auth: KVAuth | None = None) -> None:
        if not ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s must be > 0, got {ack_timeout_s!r}")
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        self.ack_timeout_s = ack_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.auth = auth  # with one, every header and grant request carries the transfer's token
        self.sender_id = uuid.uuid4().hex
        self.layout: KVLayout | None = None
        self.endpoint = ""
        self.closed = False
        self._lock = threading.Lock()
        self._transfers: dict[str, _Transfer] = {}  # not yet reported by poll()
        self._reported: OrderedDict[str, None] = OrderedDict()  # recent terminal ids (bounded)
        self._failed_peer = ""
        self._stopped = False  # the I/O thread has exited
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._waker = Waker()
        self._thread: threading.Thread | None = None
        self._stats = StatsCounter(self.backend)
        # I/O thread only
        self._open: dict[str, _Transfer] = {}
        self._by_seq: dict[int, _Transfer] = {}
        self._seq = 0
        self._last_heard = 0.0
        self._quiet_since: float | None = None
        self._last_ping = 0.0

    # -- engine thread ------------------------------------------------------------------------

    def connect(self, endpoint: str, layout: KVLayout) -> None:
        if self.closed:
            raise KVTransferError("sender is closed")
        if self._thread is not None:
            raise KVTransferError(f"already connected to {self.endpoint}")
        self._handshake(endpoint, layout)
        self.layout, self.endpoint = layout, endpoint
        self._thread = threading.Thread(target=self._run, name=f"kv-send {endpoint}", daemon=True)
        self._thread.start()

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
        self._enqueue(transfer_id, ("finish", _Finish(first_token)))

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
        return self._failed_peer

    def close(self) -> None:
        """Stop the I/O thread (it fails what is open, says goodbye, closes the transport).
        Should the thread not stop in time (stuck in a transport call), open transfers are
        reported FAILED anyway: the caller is shutting down and frees everything regardless."""
        if self.closed:
            return
        self.closed = True
        thread = self._thread
        if thread is not None:
            self._post(("close",))
            thread.join(timeout=self.connect_timeout_s + 5.0)
            if thread.is_alive():
                log.warning("KV sender I/O thread for %s did not stop", self.endpoint)
        with self._lock:
            self._stopped = True
            for t in self._transfers.values():
                if t.result is None:
                    t.result = TransferStatus(TransferState.FAILED, "sender closed")
        if thread is None or not thread.is_alive():
            self._waker.close()

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
    ) -> _Unit:
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
        ids = tuple(int(b) for b in src_block_ids)
        if not ids:
            raise ValueError(f"{transfer_id}: src_block_ids is empty")
        bad = [b for b in ids if not 0 <= b < source.shape[1]]
        if bad:
            raise ValueError(f"{transfer_id}: src block ids {bad} out of range [0, {source.shape[1]})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{transfer_id}: duplicate src block ids in {list(ids)}")
        return _Unit(layer, first_block, source, ids)

    def _enqueue(self, transfer_id: str, command: tuple[Any, ...]) -> None:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                t = self._transfers[transfer_id] = _Transfer(transfer_id, time.monotonic())
            if t.result is not None:
                return  # already terminal, not yet polled: nothing more to do for it
            if self._stopped or self._thread is None:
                t.result = TransferStatus(TransferState.FAILED, self._failed_peer or "sender closed")
                return
        self._post((command[0], t, *command[1:]))

    def _post(self, message: tuple[Any, ...]) -> None:
        """Hand a message to the I/O thread (from any thread)."""
        self._inbox.append(message)
        self._waker.wake()

    # -- I/O thread: the loop ----------------------------------------------------------------

    def _run(self) -> None:
        self._last_heard = time.monotonic()
        try:
            while True:
                self._io_wait(self._timeout())
                if self._drain_inbox():
                    break
                now = time.monotonic()
                self._io_tick(now)
                self._check_deadlines(now)
                self._transmit_round()
        except Exception as e:  # a bug here must surface as failures, not a silent hang
            log.exception("KV sender I/O thread for %s crashed", self.endpoint)
            self._peer_failed(f"sender I/O thread crashed: {e!r}")
        finally:
            for t in list(self._open.values()):
                self._finish_transfer(t, TransferStatus(TransferState.FAILED, "sender closed"))
            with self._lock:
                self._stopped = True
            try:
                self._io_close()
            except Exception:
                log.exception("closing the KV sender transport for %s failed", self.endpoint)

    def _timeout(self) -> float:
        if self._inbox or any(t.grant is not None and t.queue for t in self._open.values()):
            return 0.0
        now = time.monotonic()
        due = now + MAX_WAIT_S
        for t in self._open.values():
            if t.grant is None and t.asked_at is not None:
                due = min(due, t.asked_at + self.ack_timeout_s)
            if t.inflight:
                due = min(due, next(iter(t.inflight.values())))  # sent in order: the oldest first
        extra = self._io_next_due()
        if extra is not None:
            due = min(due, extra)
        return max(0.0, due - now)

    def _drain_inbox(self) -> bool:
        """Apply every queued message; True when close() asked the thread to stop."""
        while self._inbox:
            kind, *args = self._inbox.popleft()
            if kind == "close":
                return True
            getattr(self, f"_cmd_{kind}")(*args)
        return False

    def _cmd_send(self, t: _Transfer, unit: _Unit) -> None:
        if self._adopt(t):
            t.queue.append(unit)

    def _cmd_finish(self, t: _Transfer, fin: _Finish) -> None:
        if self._adopt(t):
            t.queue.append(fin)

    def _cmd_abort(self, t: _Transfer, reason: str) -> None:
        if t.result is not None:
            return
        self._open.setdefault(t.transfer_id, t)
        self._fail(t, f"aborted: {reason}", tell_receiver=reason)

    def _cmd_grant(self, grant: Grant) -> None:
        self._on_grant(grant)

    def _cmd_ack(self, ack: Ack) -> None:
        self._on_ack(ack)

    def _cmd_revoke(self, revoke: Revoke) -> None:
        self._on_revoke(revoke)

    def _cmd_fail(self, transfer_id: str, reason: str) -> None:
        t = self._open.get(transfer_id)
        if t is not None:
            self._fail(t, reason, tell_receiver=reason)

    def _cmd_peer_dead(self, reason: str) -> None:
        self._peer_failed(reason)

    def _adopt(self, t: _Transfer) -> bool:
        """Make `t` open on the I/O thread (asking for its grant); False if it is terminal."""
        if t.result is not None:
            return False
        if self._open.get(t.transfer_id) is not t:
            self._open[t.transfer_id] = t
        if self._failed_peer:
            self._finish_transfer(t, TransferStatus(TransferState.FAILED, self._failed_peer))
            return False
        if t.asked_at is None:
            t.asked_at = time.monotonic()
            self._io_ask(t)
        return t.result is None

    # -- I/O thread: incoming messages -------------------------------------------------------

    def _heard(self) -> None:
        """Any message from the receiver: it is alive."""
        self._last_heard = time.monotonic()

    def _on_grant(self, grant: Grant) -> None:
        self._heard()
        t = self._open.get(grant.transfer_id)
        if t is None or t.grant is not None:
            return  # a transfer we gave up on (the receiver heard our abort), or a repeat
        if not grant.ok:
            if grant.reason == "pending":  # a gRPC long poll ran out before our deadline
                if time.monotonic() < (t.asked_at or 0.0) + self.ack_timeout_s:
                    self._io_ask(t)
                return
            self._fail(t, f"receiver refused the grant for {t.transfer_id}: {grant.reason}")
            return
        t.grant = grant
        t.sent = [set() for _ in range(grant.num_layers)]
        self._stats.add(skipped_blocks=grant.skip_blocks)

    def _on_ack(self, ack: Ack) -> None:
        self._heard()
        t = self._by_seq.pop(ack.seq, None)
        if t is None or t.result is not None:
            return  # a transfer already reported
        t.inflight.pop(ack.seq, None)
        layer = t.layers.pop(ack.seq, ack.layer)
        if not ack.ok:
            what = "finish" if ack.seq == t.finish_seq else f"layer {layer}"
            self._fail(t, f"receiver refused {what}: {ack.reason}", tell_receiver=ack.reason)
            return
        if ack.seq == t.finish_seq:
            t.finish_acked = True
        if t.finish_acked and not t.inflight and not t.queue:
            self._finish_transfer(t, TransferStatus(TransferState.DONE))

    def _on_revoke(self, revoke: Revoke) -> None:
        """Runs on the thread that writes, so every write before it is done: say so."""
        self._heard()
        t = self._open.get(revoke.transfer_id)
        if t is not None:
            self._fail(t, f"receiver revoked the transfer: {revoke.reason or 'cancelled'}")
        self._io_revoked(revoke.transfer_id)

    # -- I/O thread: transmission ------------------------------------------------------------

    def _transmit_round(self) -> None:
        """One queued item of every granted transfer (round robin keeps replies flowing)."""
        for t in list(self._open.values()):
            if t.grant is None or not t.queue or t.result is not None:
                continue
            item = t.queue.popleft()
            if isinstance(item, _Unit):
                self._transmit_unit(t, item)
            else:
                self._transmit_finish(t, item)

    def _transmit_unit(self, t: _Transfer, unit: _Unit) -> None:
        grant = t.grant
        assert grant is not None  # _transmit_round checked it
        if unit.layer >= grant.num_layers:
            self._fail(t, f"layer {unit.layer} beyond the {grant.num_layers} layers granted",
                       tell_receiver="layer beyond the grant")
            return
        granted = len(grant.block_ids)
        src_ids: list[int] = []
        dst_ids: list[int] = []
        for k, src in enumerate(unit.src_block_ids):
            index = unit.first_block + k
            if index < grant.skip_blocks:
                continue  # the receiver has it cached
            j = index - grant.skip_blocks
            if j >= granted:
                self._fail(t, f"block {index} beyond the {grant.skip_blocks + granted} blocks granted",
                           tell_receiver="block beyond the grant")
                return
            src_ids.append(src)
            dst_ids.append(grant.block_ids[j])
            t.sent[unit.layer].add(index)
        if not src_ids:
            return
        seq = self._track(t, unit.layer)
        error = self._io_transmit(t, unit.layer, unit.source, tuple(src_ids), tuple(dst_ids), seq)
        if error:
            self._untrack(t, seq)
            self._fail(t, error, tell_receiver=error)
            return
        t.units_sent += 1
        assert self.layout is not None
        self._stats.add(bytes=self.layout.payload_nbytes(len(dst_ids)), units=1)

    def _transmit_finish(self, t: _Transfer, fin: _Finish) -> None:
        grant = t.grant
        assert grant is not None
        want = set(range(grant.skip_blocks, grant.skip_blocks + len(grant.block_ids)))
        for layer, sent in enumerate(t.sent):
            missing = sorted(want - sent)
            if missing:
                self._fail(t, f"finish() before every granted block was sent: layer {layer} "
                           f"lacks blocks {missing[:8]}{'...' if len(missing) > 8 else ''}",
                           tell_receiver="finished with blocks missing")
                return
        seq = self._track(t, -1)
        t.finish_seq = seq
        self._io_control(t, KVHeader(t.transfer_id, seq=seq, sender_id=self.sender_id, finish=True,
                                     first_token=fin.first_token, num_units=t.units_sent,
                                     auth_token=self.token(t.transfer_id)))

    def _track(self, t: _Transfer, layer: int) -> int:
        self._seq += 1
        t.inflight[self._seq] = time.monotonic() + self.ack_timeout_s
        t.layers[self._seq] = layer
        self._by_seq[self._seq] = t
        return self._seq

    def _untrack(self, t: _Transfer, seq: int) -> None:
        t.inflight.pop(seq, None)
        t.layers.pop(seq, None)
        self._by_seq.pop(seq, None)

    def gather(self, source: torch.Tensor, src_ids: tuple[int, ...]) -> torch.Tensor:
        """source[:, src_ids] as a fresh contiguous CPU tensor (the payload)."""
        idx = torch.tensor(src_ids, dtype=torch.long, device=source.device)
        return source.index_select(1, idx).cpu().contiguous()

    def data_header(
        self, t: _Transfer, layer: int, dst_ids: tuple[int, ...], payload: torch.Tensor | None,
        seq: int, crc: int | None = None,
    ) -> KVHeader:
        assert self.layout is not None
        return KVHeader.for_payload(t.transfer_id, layer, dst_ids, payload, self.layout, seq,
                                    sender_id=self.sender_id, crc=crc,
                                    auth_token=self.token(t.transfer_id))

    def token(self, transfer_id: str) -> bytes:
        """The transfer's token (kvtransfer/auth.py), b"" without credentials."""
        return b"" if self.auth is None else self.auth.token(transfer_id)

    # -- I/O thread: deadlines and failures --------------------------------------------------

    def _check_deadlines(self, now: float) -> None:
        # Peer silence first: when a transfer's own deadline (no grant, no ack) and the peer's
        # silence (heartbeat backends) expire together, the peer is dead, and saying so
        # (failed_peer) must not depend on which check happens to run first.
        # A transfer deadline that expires while the peer has not answered even the pings of
        # the last half of the wait (they go every ack_timeout_s / 4 while anything is
        # outstanding) means a dead peer, not a transfer the receiver refused to expect.
        if self.heartbeat and self._quiet_since is not None and any(
                (t.grant is None and t.asked_at is not None
                 and now > t.asked_at + self.ack_timeout_s)
                or (t.inflight and now > next(iter(t.inflight.values())))
                for t in self._open.values()):
            silent = now - max(self._last_heard, self._quiet_since)
            if silent > self.ack_timeout_s / 2:
                self._peer_failed(f"receiver at {self.endpoint} silent for {silent:.1f}s")
                return
        outstanding = False
        for t in list(self._open.values()):
            if t.grant is None and t.asked_at is not None:
                outstanding = True
                if now > t.asked_at + self.ack_timeout_s:
                    self._fail(t, f"no grant for {t.transfer_id} within {self.ack_timeout_s}s "
                               "(receiver did not expect it, or is dead or unreachable)",
                               tell_receiver="no grant in time")
                    continue
            if t.inflight:
                outstanding = True
                if now <= next(iter(t.inflight.values())):  # sent in order: the oldest first
                    continue
                late = [t.layers.get(s, -1) for s, d in t.inflight.items() if now > d]
                if late:
                    what = ["finish" if layer < 0 else layer for layer in late]
                    layers = [layer for layer in what if layer != "finish"]
                    self._fail(t, f"no ack for {'layers ' + str(layers) if layers else 'finish'} "
                               f"within {self.ack_timeout_s}s (receiver dead or unreachable?)",
                               tell_receiver="no ack in time")
        if not self.heartbeat:
            return
        # Pings go while any transfer is open, even one waiting for its next layer: the
        # receiver takes a granted sender's silence for a cut link (zmq_backend.SENDER_SILENCE_S).
        if self._open and now - self._last_ping > min(1.0, self.ack_timeout_s / 4):
            self._last_ping = now
            self._io_ping()
        if not outstanding:
            self._quiet_since = None
            return
        if self._quiet_since is None:
            self._quiet_since = now
        silent = now - max(self._last_heard, self._quiet_since)
        if silent > self.ack_timeout_s:
            self._peer_failed(f"receiver at {self.endpoint} silent for {silent:.1f}s")

    def _fail(self, t: _Transfer, reason: str, tell_receiver: str = "") -> None:
        """FAILED; with tell_receiver, an abort unit tells the receiver we stopped (and why)."""
        if t.result is not None:
            return
        self._finish_transfer(t, TransferStatus(TransferState.FAILED, reason))
        if tell_receiver and not self._failed_peer:
            try:
                self._io_control(t, KVHeader(t.transfer_id, sender_id=self.sender_id,
                                             sender_error=tell_receiver,
                                             auth_token=self.token(t.transfer_id)))
            except Exception as e:  # best effort: the receiver's deadline covers a lost abort
                log.warning("could not tell %s about aborting %s: %r", self.endpoint, t.transfer_id, e)

    def _peer_failed(self, reason: str) -> None:
        with self._lock:
            self._failed_peer = self._failed_peer or reason
        for t in list(self._open.values()):
            self._finish_transfer(t, TransferStatus(TransferState.FAILED, f"receiver unreachable: {reason}"))

    def _finish_transfer(self, t: _Transfer, status: TransferStatus) -> None:
        """Publish a terminal status; from here on the I/O thread never touches t's source."""
        t.queue.clear()
        for seq in list(t.inflight):
            self._by_seq.pop(seq, None)
        t.inflight.clear()
        if self._open.get(t.transfer_id) is t:
            del self._open[t.transfer_id]
        with self._lock:
            if t.result is not None:
                return
            t.result = status
        elapsed = time.monotonic() - t.started
        if status.done:
            self._stats.add(transfers_done=1, seconds=elapsed)
        else:
            self._stats.add(transfers_failed=1, seconds=elapsed)

    # -- the transport (subclasses) ----------------------------------------------------------

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

    def _io_wait(self, timeout: float) -> None:
        """Block until the waker fires, a transport message arrives (dispatch it to _on_*) or
        `timeout` passes."""
        self._waker.wait(timeout)

    @abstractmethod
    def _io_ask(self, t: _Transfer) -> None:
        """Ask the receiver for t's grant."""

    @abstractmethod
    def _io_transmit(
        self, t: _Transfer, layer: int, source: torch.Tensor, src_ids: tuple[int, ...],
        dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        """Move source[:, src_ids] into the receiver's blocks dst_ids of `layer` as unit `seq`
        (its ack arrives later through _on_ack). Returns "" or why the transfer must fail."""

    @abstractmethod
    def _io_control(self, t: _Transfer, header: KVHeader) -> None:
        """Send a finish or abort unit."""

    def _io_revoked(self, transfer_id: str) -> None:
        """Tell the receiver this thread writes nothing more for transfer_id."""

    def _io_ping(self) -> None:
        """Ask for any reply (heartbeat backends only)."""

    def _io_tick(self, now: float) -> None:
        """Once per loop iteration (the fake delivers delayed units here)."""

    def _io_next_due(self) -> float | None:
        """A monotonic time the loop must wake at, besides the deadlines."""
        return None

    def _io_close(self) -> None:
        """At I/O thread exit: say goodbye, close the transport."""
