"""A sender's I/O thread: the state machine of every open transfer (grants, acks, revocations,
deadlines, pings, dead-peer detection). One SendLoop per sender; it owns the transport
(`transport`, a SenderHooks) and is the only thread that calls it after connect(). How the
engine thread hands it work is drawn in sender.py.

Per transfer, on the I/O thread:

    queued --(grant)--> transmitting --(finish acked, no unit in flight)--> DONE
       |                    |
       +--------------------+--(refused grant/unit, no grant or ack within ack_timeout_s,
                                 revoke, abort(), dead peer, close())--> FAILED

Invariants:
- A terminal status is published (under the sender's lock) only after this thread dropped
  every queued unit of the transfer, so it never reads the caller's `source` again: the caller
  may free the blocks as soon as poll() says so. Blocks are freed by the engine's scheduler
  only, never here and never on a timer.
- On a failure it did not hear from the receiver (deadline, abort(), owner table) the loop
  tells the receiver with an abort unit, which lets a receiver waiting for a revocation
  release the blocks at once.
- Only this thread touches an OutgoingTransfer's fields besides `result`, and `_open`,
  `_by_seq` and the heartbeat clocks. The backend calls on_grant/on_ack/on_revoke/heard/
  peer_failed from this thread only; other threads call start/stop (the engine, once each)
  and post() (any thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

from .base import TransferState, TransferStatus, TransferTimes
from .layout import KVLayout
from .message import Ack, Grant, KVHeader, Revoke
from .sender_hooks import SenderHooks
from .stats import StatsCounter
from .transfer import FinishUnit, OutgoingTransfer, SendUnit
from .waker import Waker

log = logging.getLogger(__name__)

MAX_WAIT_S = 0.5  # the I/O thread wakes at least this often (closing, pings)


class SendLoop:
    """The I/O thread of one sender. `lock` is the sender's: it guards each transfer's
    `result`, `failed_peer` and `stopped`, which the engine thread reads."""

    def __init__(self, transport: SenderHooks, sender_id: str, ack_timeout_s: float,
                 lock: threading.Lock, stats: StatsCounter, waker: Waker) -> None:
        self.transport = transport
        self.sender_id = sender_id
        self.ack_timeout_s = ack_timeout_s
        self.heartbeat = transport.heartbeat
        self.endpoint = ""
        self.layout: KVLayout | None = None
        self.thread: threading.Thread | None = None
        self.failed_peer = ""  # non-empty once the receiver is known dead; under the lock
        self.stopped = False  # the thread has exited (or never will run); under the lock
        self._lock = lock
        self._stats = stats
        self._waker = waker
        self._inbox: deque[tuple[Any, ...]] = deque()
        # I/O thread only
        self._open: dict[str, OutgoingTransfer] = {}
        self._by_seq: dict[int, OutgoingTransfer] = {}
        self._seq = 0
        self._last_heard = 0.0
        self._quiet_since: float | None = None
        self._last_ping = 0.0

    # -- any thread -----------------------------------------------------------------------------

    def start(self, endpoint: str, layout: KVLayout) -> None:
        self.endpoint, self.layout = endpoint, layout
        self.thread = threading.Thread(target=self.run, name=f"kv-send {endpoint}", daemon=True)
        self.thread.start()

    @property
    def running(self) -> bool:
        """Whether posted work will be handled (read under the lock)."""
        return self.thread is not None and not self.stopped

    def post(self, message: tuple[Any, ...]) -> None:
        """Hand a message to the I/O thread (from any thread)."""
        self._inbox.append(message)
        self._waker.wake()

    def stop(self, join_timeout_s: float) -> None:
        """Ask the thread to stop and wait for it (it fails what is open, says goodbye, closes
        the transport); afterwards nothing posted is handled."""
        thread = self.thread
        if thread is not None:
            self.post(("close",))
            thread.join(timeout=join_timeout_s)
            if thread.is_alive():
                log.warning("KV sender I/O thread for %s did not stop", self.endpoint)
        with self._lock:
            self.stopped = True
        if thread is None or not thread.is_alive():
            self._waker.close()

    # -- I/O thread: the loop ----------------------------------------------------------------

    def run(self) -> None:
        self._last_heard = time.monotonic()
        try:
            while True:
                self.transport._io_wait(self._timeout())
                if self._drain_inbox():
                    break
                now = time.monotonic()
                self.transport._io_tick(now)
                self._check_deadlines(now)
                self._transmit_round()
        except Exception as e:  # a bug here must surface as failures, not a silent hang
            log.exception("KV sender I/O thread for %s crashed", self.endpoint)
            self.peer_failed(f"sender I/O thread crashed: {e!r}")
        finally:
            for t in list(self._open.values()):
                self._finish_transfer(t, TransferStatus(TransferState.FAILED, "sender closed"))
            with self._lock:
                self.stopped = True
            try:
                self.transport._io_close()
            except Exception:
                log.exception("closing the KV sender transport for %s failed", self.endpoint)

    def _timeout(self) -> float:
        if self._inbox or (any(t.grant is not None and t.queue for t in self._open.values())
                           and self.transport._io_can_transmit()):
            return 0.0
        now = time.monotonic()
        due = now + MAX_WAIT_S
        for t in self._open.values():
            if t.grant is None and t.asked_at is not None:
                due = min(due, t.asked_at + self.ack_timeout_s)
            if t.inflight:
                due = min(due, next(iter(t.inflight.values())))  # sent in order: the oldest first
        extra = self.transport._io_next_due()
        if extra is not None:
            due = min(due, extra)
        return max(0.0, due - now)

    def _drain_inbox(self) -> bool:
        """Apply every queued message; True when close() asked the thread to stop."""
        handlers = {"send": self._cmd_queue, "finish": self._cmd_queue, "abort": self._cmd_abort,
                    "grant": self.on_grant, "ack": self.on_ack, "revoke": self.on_revoke,
                    "fail": self._cmd_fail, "peer_dead": self.peer_failed}
        while self._inbox:
            kind, *args = self._inbox.popleft()
            if kind == "close":
                return True
            handlers[kind](*args)
        return False

    def _cmd_queue(self, t: OutgoingTransfer, item: SendUnit | FinishUnit) -> None:
        if self._adopt(t):
            t.queue.append(item)

    def _cmd_abort(self, t: OutgoingTransfer, reason: str) -> None:
        if t.result is not None:
            return
        self._open.setdefault(t.transfer_id, t)
        self._fail(t, f"aborted: {reason}", tell_receiver=reason)

    def _cmd_fail(self, transfer_id: str, reason: str) -> None:
        t = self._open.get(transfer_id)
        if t is not None:
            self._fail(t, reason, tell_receiver=reason)

    def _adopt(self, t: OutgoingTransfer) -> bool:
        """Make `t` open on the I/O thread (asking for its grant); False if it is terminal."""
        if t.result is not None:
            return False
        if self._open.get(t.transfer_id) is not t:
            self._open[t.transfer_id] = t
        if self.failed_peer:
            self._finish_transfer(t, TransferStatus(TransferState.FAILED, self.failed_peer))
            return False
        if t.asked_at is None:
            t.asked_at = time.monotonic()
            t.asked_ns = time.time_ns()
            self.transport._io_ask(t)
        return t.result is None

    # -- I/O thread: incoming messages -------------------------------------------------------

    def heard(self) -> None:
        """Any message from the receiver: it is alive."""
        self._last_heard = time.monotonic()

    def on_grant(self, grant: Grant) -> None:
        self.heard()
        t = self._open.get(grant.transfer_id)
        if t is None or t.grant is not None:
            return  # a transfer we gave up on (the receiver heard our abort), or a repeat
        if not grant.ok:
            if grant.reason == "pending":  # a gRPC long poll ran out before our deadline
                if time.monotonic() < (t.asked_at or 0.0) + self.ack_timeout_s:
                    self.transport._io_ask(t)
                return
            self._fail(t, f"receiver refused the grant for {t.transfer_id}: {grant.reason}")
            return
        t.grant = grant
        t.granted_ns = time.time_ns()
        t.sent = [set() for _ in range(grant.num_layers)]
        self._stats.add(skipped_blocks=grant.skip_blocks)

    def on_ack(self, ack: Ack) -> None:
        self.transport._io_acked(ack)
        self.heard()
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
        else:
            t.last_ack_ns = time.time_ns()
        if t.finish_acked and not t.inflight and not t.queue:
            self._finish_transfer(t, TransferStatus(TransferState.DONE))

    def on_revoke(self, revoke: Revoke) -> None:
        """Runs on the thread that writes, so every write before it is done: say so."""
        self.heard()
        t = self._open.get(revoke.transfer_id)
        if t is not None:
            self._fail(t, f"receiver revoked the transfer: {revoke.reason or 'cancelled'}")
        self.transport._io_revoked(revoke.transfer_id)

    # -- I/O thread: transmission ------------------------------------------------------------

    def _transmit_round(self) -> None:
        """One queued item of every granted transfer (round robin keeps replies flowing)."""
        for t in list(self._open.values()):
            if t.grant is None or not t.queue or t.result is not None:
                continue
            if not self.transport._io_can_transmit():
                return  # flow control: the loop comes back at the transport's _io_next_due
            item = t.queue.popleft()
            if isinstance(item, SendUnit):
                self._transmit_unit(t, item, self._take_next_layers(t, item))
                # A finish queued right behind the last unit goes with it, not a loop turn
                # later: the transfer's tail is a round trip, not two.
                if t.result is None and t.queue and isinstance(t.queue[0], FinishUnit):
                    self._transmit_finish(t, t.queue.popleft())
            else:
                self._transmit_finish(t, item)

    def _take_next_layers(self, t: OutgoingTransfer, unit: SendUnit) -> tuple[SendUnit, ...]:
        """The queued units that can travel in one unit with `unit`: the next layers' sends of
        the same blocks, in order, up to what the transport takes in one unit. Only units that
        are already queued join, so packing never delays a layer: it saves the per-unit work
        (header, ack, owner check, loop turn) when the engine outran this thread."""
        assert self.layout is not None
        limit = self.transport._io_unit_layers(self.layout.payload_nbytes(len(unit.src_block_ids)))
        joined: list[SendUnit] = []
        while len(joined) + 1 < limit and t.queue:
            nxt = t.queue[0]
            if not (isinstance(nxt, SendUnit) and nxt.layer == unit.layer + len(joined) + 1
                    and nxt.first_block == unit.first_block
                    and nxt.src_block_ids == unit.src_block_ids
                    and nxt.source.shape == unit.source.shape
                    and nxt.source.dtype == unit.source.dtype
                    and nxt.source.device == unit.source.device):
                break
            joined.append(t.queue.popleft())
        return tuple(joined)

    def _transmit_unit(self, t: OutgoingTransfer, unit: SendUnit, more: tuple[SendUnit, ...] = ()) -> None:
        """Transmit `unit` and `more` (the next layers' sends of the same blocks) as one unit."""
        grant = t.grant
        assert grant is not None  # _transmit_round checked it
        last = unit.layer + len(more)
        if last >= grant.num_layers:
            self._fail(t, f"layer {last} beyond the {grant.num_layers} layers granted",
                       tell_receiver="layer beyond the grant")
            return
        # Block index first + k of the request is destination grant.block_ids[first + k - skip]
        # (indices below skip are cached on the receiver): slices, not a loop per block.
        first, count, skip = unit.first_block, len(unit.src_block_ids), grant.skip_blocks
        granted = len(grant.block_ids)
        lo = min(count, max(0, skip - first))  # unit.src_block_ids[:lo] are cached
        if first + count - skip > granted:
            index = max(first + lo, skip + granted)
            self._fail(t, f"block {index} beyond the {skip + granted} blocks granted",
                       tell_receiver="block beyond the grant")
            return
        src_ids = unit.src_block_ids[lo:]
        dst_ids = grant.block_ids[first + lo - skip:first + count - skip]
        for layer in range(unit.layer, last + 1):
            t.sent[layer].update(range(first + lo, first + count))
        if not src_ids:
            return
        seq = self._track(t, unit.layer)
        sources = (unit.source,) + tuple(u.source for u in more)
        error = self.transport._io_transmit(t, unit.layer, sources, src_ids, dst_ids, seq)
        if error:
            self._untrack(t, seq)
            self._fail(t, error, tell_receiver=error)
            return
        t.units_sent += 1
        if not t.first_unit_ns:
            t.first_unit_ns = time.time_ns()
        assert self.layout is not None
        self._stats.add(bytes=len(sources) * self.layout.payload_nbytes(len(dst_ids)), units=1)

    def _transmit_finish(self, t: OutgoingTransfer, fin: FinishUnit) -> None:
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
        t.finish_ns = time.time_ns()
        self.transport._io_control(t, KVHeader(
            t.transfer_id, seq=seq, sender_id=self.sender_id, finish=True,
            first_token=fin.first_token, num_units=t.units_sent,
            auth_token=self.transport.token(t.transfer_id)))

    def _track(self, t: OutgoingTransfer, layer: int) -> int:
        self._seq += 1
        t.inflight[self._seq] = time.monotonic() + self.ack_timeout_s
        t.layers[self._seq] = layer
        self._by_seq[self._seq] = t
        return self._seq

    def _untrack(self, t: OutgoingTransfer, seq: int) -> None:
        t.inflight.pop(seq, None)
        t.layers.pop(seq, None)
        self._by_seq.pop(seq, None)

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
                self.peer_failed(f"receiver at {self.endpoint} silent for {silent:.1f}s")
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
            self.transport._io_ping()
        if not outstanding:
            self._quiet_since = None
            return
        if self._quiet_since is None:
            self._quiet_since = now
        silent = now - max(self._last_heard, self._quiet_since)
        if silent > self.ack_timeout_s:
            self.peer_failed(f"receiver at {self.endpoint} silent for {silent:.1f}s")

    def _fail(self, t: OutgoingTransfer, reason: str, tell_receiver: str = "") -> None:
        """FAILED; with tell_receiver, an abort unit tells the receiver we stopped (and why)."""
        if t.result is not None:
            return
        self._finish_transfer(t, TransferStatus(TransferState.FAILED, reason))
        if tell_receiver and not self.failed_peer:
            try:
                header = KVHeader(t.transfer_id, sender_id=self.sender_id, sender_error=tell_receiver,
                                  auth_token=self.transport.token(t.transfer_id))
                self.transport._io_control(t, header)
            except Exception as e:  # best effort: the receiver's deadline covers a lost abort
                log.warning("could not tell %s about aborting %s: %r", self.endpoint, t.transfer_id, e)

    def peer_failed(self, reason: str) -> None:
        self.transport._io_peer_failed(reason)
        with self._lock:
            self.failed_peer = self.failed_peer or reason
        for t in list(self._open.values()):
            self._finish_transfer(t, TransferStatus(TransferState.FAILED, f"receiver unreachable: {reason}"))

    def _finish_transfer(self, t: OutgoingTransfer, status: TransferStatus) -> None:
        """Publish a terminal status; from here on the I/O thread never touches t's source."""
        t.queue.clear()
        for seq in list(t.inflight):
            self._by_seq.pop(seq, None)
        t.inflight.clear()
        if self._open.get(t.transfer_id) is t:
            del self._open[t.transfer_id]
        status = replace(status, times=TransferTimes(
            t.asked_ns, t.granted_ns, t.first_unit_ns, t.last_ack_ns, t.finish_ns,
            time.time_ns(), t.units_sent))
        with self._lock:
            if t.result is not None:
                return
            t.result = status
        elapsed = time.monotonic() - t.started
        if status.done:
            self._stats.add(transfers_done=1, seconds=elapsed)
        else:
            self._stats.add(transfers_failed=1, seconds=elapsed)

