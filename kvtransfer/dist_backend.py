"""torch.distributed transport: each unit's payload goes point to point over a 2-rank process
group per (sender, receiver) pair (NCCL between GPUs, gloo otherwise: the same code, another
group class; kvtransfer/dist_group.py); everything else uses zmq_backend.py's control
channel, so the handshake (layout fingerprint, KVLayoutMismatch), grants, acks, pings, finish,
abort, revocations and goodbyes are the zmq backend's.

    sender (connect(), then its I/O thread)     receiver
    [H, HandshakeRequest]               --->    as zmq
                                        <---    [W, HandshakeReply]   layout checked here
    [S, {sender id, pid, start, gpu,    --->    proof checked (with a secret), pick the group
         proof}]                                class, draw the pair key, start the pair's thread
                                        <---    [s, {ok, store port, group backend, pair key}]
    join the group as rank 1 (PrefixStore(pair key) of the receiver's TCPStore, rank 0)
    per unit: group.send(payload)  and  [T, KVHeader]  --->  the pair's thread, in header
                                                             order: group.recv(declared bytes)
                                                             into scratch (RECV_DEPTH posted
                                                             ahead), then validate and write
                                        <---    [A, Ack]     as zmq (ReceiveTable.ingest)
    (the sender keeps each send's Work and payload until that ack, then collects it)

Ordering invariant: per pair, headers cross zmq and tensors cross the group in the same order
(both from the sender's one I/O thread), and the pair's thread posts exactly one recv per
header, in header order, whatever becomes of the unit: a unit the table refuses (unexpected
transfer, foreign blocks, bad fingerprint or checksum...) is received into scratch all the
same and dropped, so the next unit lands correctly. Nothing reaches the cache before the table
validated it. A header whose declared size is not exactly the bytes of the blocks it names
(layout.payload_nbytes(len(block_ids)), at most one layer of the cache), or that cannot be
decoded, leaves the stream unknowable: the pair is killed (its transfers fail, the group is
dropped), never resynchronized, and no recv of that size is ever posted. That check is what
keeps gloo alive: gloo terminates the process when a payload is larger than its posted recv,
so the receiver never posts one that an honest sender's tensor could exceed.

Block ownership: the receiver writes every byte itself under the table lock (two-sided, like
zmq), so a failed or cancelled transfer's blocks are RELEASED at once. A dead sender process
surfaces as the group's "connection closed" on a pending recv, or (same host) through the
process fence checked every ~100 ms: the pair dies and its transfers FAIL and are RELEASED.
A dead receiver surfaces on the sender through the zmq heartbeat or a failed group send:
failed_peer.

Trust: with a keyed KVAuth the control channel is zmq's (CURVE, and every header's transfer
token is checked by the table before its payload may reach the cache), and a pair forms only
after its request's proof (KVAuth.handshake_proof over the sender id) checked out; the pair's
store namespace is a random key sent over that channel alone, so a blind peer on the store
port cannot place its address in a live rendezvous by naming a sender. What stays open: the
TCPStore protocol has no authentication (a client that reaches its port can list its keys, so
read a pair's key during the seconds of a rendezvous), and gloo's own connections carry none
(a peer that joins a group can send a payload larger than the posted recv, which gloo answers
by terminating the process). The store and gloo bind the receiver's interface, never 0.0.0.0;
off loopback a worker runs dist only when told --insecure-dist (worker/config.py), on a
network where every host is trusted, as shm's peers share a host.

Memory: each pair keeps RECV_DEPTH scratch buffers, each grown to its largest unit (at most one
layer of the whole cache).
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import zmq

from .auth import KVAuth
from .base import KVTransferError
from .dist_group import (
    RECEIVER_RANK, SENDER_RANK, TAG, device_uuid, endpoint_host, group_backend, host_store, join_store,
    local_address_towards, pair_group,
)
from .fence import own_identity, process_start_time, same_process_alive
from .layout import KVCacheBuffer, KVLayout
from .message import Ack, KVHeader, MessageError, tensor_bytes
from .receive_table import ReceiveTable
from .transfer import OutgoingTransfer
from .zmq_backend import ACK, BYE, DATA, NOTIFY, SENDER_SILENCE_S, ZmqReceiver, ZmqSender

log = logging.getLogger(__name__)

PAIR, PAIRED, TENSOR = b"S", b"s", b"T"
GROUP_TIMEOUT_S = 60.0  # group setup, and a recv whose announced tensor does not come
FENCE_INTERVAL_S = 0.1
RECV_DEPTH = 2  # recvs a pair keeps posted ahead (each its own scratch buffer)
SEND_WAIT_S = 5.0  # a send whose unit was acked is complete: waiting for it returns at once


class _Pair:
    """Receiver side of one sender's group: a thread that joins the group, then receives the
    announced tensors in order and hands each unit to the table."""

    def __init__(self, receiver: DistReceiver, sender_id: str, ident: bytes, pid: int, start: int,
                 backend: str) -> None:
        self.receiver, self.sender_id, self.ident, self.backend = receiver, sender_id, ident, backend
        self.key = secrets.token_hex(16)  # the pair's store namespace: unguessable, per pair
        self.fence = (pid, start) if pid > 0 and start and process_start_time(pid) == start else None
        self.dead = ""  # why the pair was killed; the I/O thread announces nothing more to it
        self._queue: queue.SimpleQueue[KVHeader | str | None] = queue.SimpleQueue()
        device = receiver.cache.tensor.device if backend == "nccl" else torch.device("cpu")
        self._slots = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(RECV_DEPTH)]
        self._posted = self._done = 0  # recvs posted / completed (pair thread only)
        self.thread = threading.Thread(target=self._run, name=f"kv-dist-recv {sender_id[:8]}", daemon=True)
        self.thread.start()

    def announce(self, header: KVHeader) -> None:
        self._queue.put(header)

    def goodbye(self) -> None:
        """The sender closed: handled after every unit it announced before."""
        self._queue.put("bye")

    def kill(self, reason: str) -> None:
        """Any thread: fail the sender's transfers now; the thread stops at its next item."""
        if self.dead:
            return
        self.dead = reason
        self.receiver.table.sender_gone(self.sender_id, reason)
        self._queue.put(None)

    def _run(self) -> None:
        r = self.receiver
        try:
            # A store client of its own: a TCPStore client is one socket, and a rendezvous that
            # waits on it would stall every other pair's setup behind a sender that never joins.
            store = join_store(r._group_host or "127.0.0.1", r._store.port, r.group_timeout_s)
            group = pair_group(store, self.key, RECEIVER_RANK, self.backend,
                               r._group_host, r.group_timeout_s)
        except Exception as e:
            self.kill(f"process group with sender {self.sender_id} not set up: {e}")
            return
        try:
            self._serve(group)
        finally:
            del group  # closes the pair's connections: the peer's pending sends fail

    def _serve(self, group) -> None:
        """Receive the announced tensors in header order, RECV_DEPTH posted ahead: gloo fills
        the next unit's buffer while the oldest is validated and written."""
        r = self.receiver
        posted: deque[tuple[KVHeader, Any]] = deque()  # (header, its recv's Work), in order
        stop: str | None = None  # "bye" or "stop", met while posting: acted on once drained
        while True:
            while stop is None and len(posted) < RECV_DEPTH:
                try:
                    item = self._queue.get(block=not posted)
                except queue.Empty:
                    break
                if not isinstance(item, KVHeader):
                    stop = item or "stop"
                    break
                try:
                    posted.append((item, self._post(group, item.payload_nbytes)))
                except Exception as e:
                    self.kill(f"process group with sender {self.sender_id} failed: {e}")
                    return
            if not posted:
                if stop == "bye":
                    self.kill("sender closed")
                return
            header, work = posted.popleft()
            try:
                work.wait()
                payload = self._slots[self._done % RECV_DEPTH][:header.payload_nbytes]
                self._done += 1
                payload = payload if payload.device.type == "cpu" else payload.cpu()
            except Exception as e:  # the peer died or hung: the stream is lost
                self.kill(f"process group with sender {self.sender_id} failed: {e}")
                return
            if self.dead:
                ack = Ack(header.seq, header.transfer_id, header.layer, False, self.dead)
            elif header.sender_id != self.sender_id:
                ack = Ack(header.seq, header.transfer_id, header.layer, False, "unit names another sender")
            else:
                ack = r.table.ingest(header, tensor_bytes(payload))
            r.reply(self.ident, ack)

    def _post(self, group, nbytes: int) -> Any:
        """Post the recv of the stream's next tensor into the next scratch slot. Slot k % DEPTH
        is free: unit k - DEPTH was written (and acked) before unit k could be posted."""
        slot = self._posted % RECV_DEPTH
        if self._slots[slot].numel() < nbytes:  # grown to the largest unit, at most one layer
            self._slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._slots[slot].device)
        work = group.recv([self._slots[slot][:nbytes]], SENDER_RANK, TAG)
        self._posted += 1
        return work


class DistReceiver(ZmqReceiver):
    one_sided = False
    multi_layer_units = False  # a unit is one group send of one layer's payload

    def __init__(self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:*",
                 group_timeout_s: float = GROUP_TIMEOUT_S, auth: KVAuth | None = None,
                 sender_silence_s: float = SENDER_SILENCE_S) -> None:
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s must be > 0, got {group_timeout_s!r}")
        self.group_timeout_s = group_timeout_s
        # The unit the layout allows at most: one layer of the whole cache.
        self._max_unit_bytes = layout.payload_nbytes(cache.num_blocks)
        host = endpoint[len("tcp://"):].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else "127.0.0.1"
        if host.strip("[]") in ("*", "0.0.0.0", "::", ""):
            # The store and gloo listen where the control channel does: on every interface,
            # an unauthenticated store would face every network this host is on.
            raise ValueError(f"a dist receiver binds one interface, not {endpoint!r}: name its "
                             f"address (decode_node uses --advertise-host for a wildcard --host)")
        self._group_host = host.strip("[]")
        self._store = host_store(self._group_host, group_timeout_s)
        self._pairs: dict[str, _Pair] = {}  # sender id -> pair (I/O thread; read by close)
        self._by_ident: dict[bytes, _Pair] = {}
        self._acks: deque[tuple[bytes, Ack]] = deque()  # from pair threads to the I/O thread
        self._next_fence = 0.0
        super().__init__(cache, layout, endpoint, auth, sender_silence_s)

    def _make_table(self) -> ReceiveTable:
        return ReceiveTable(self.cache, self.layout, self._deliver, "dist", auth=self.auth)

    def reply(self, ident: bytes, ack: Ack) -> None:
        """A pair thread's ack: sent by the I/O thread, which owns the socket."""
        self._acks.append((ident, ack))
        self._waker.wake()

    def close(self) -> None:
        if self._closed:
            return
        super().close()  # the I/O thread has stopped: no pair is added any more
        for pair in list(self._pairs.values()):
            pair.kill("receiver closed")
        for pair in list(self._pairs.values()):
            pair.thread.join(timeout=2.0)  # one stuck in a recv ends at its group's timeout
        self._pairs.clear()
        self._by_ident.clear()
        self._store = None

    # -- I/O thread -------------------------------------------------------------------------

    def _handle(self, frames: list[zmq.Frame]) -> list[bytes] | None:
        ident = frames[0].bytes
        kind = frames[1].bytes if len(frames) > 1 else b""
        if kind == PAIR and len(frames) == 3:
            return [PAIRED, json.dumps(self._open_pair(ident, frames[2].bytes)).encode()]
        if kind == TENSOR and len(frames) == 3:
            return self._announce(ident, frames[2].buffer)
        if kind == BYE and len(frames) == 3 and frames[2].bytes.decode() in self._pairs:
            self._pairs.pop(frames[2].bytes.decode()).goodbye()
            self._by_ident.pop(ident, None)
            return None
        if kind in (DATA, NOTIFY):  # a zmq or shm sender: one data path per backend
            self.table.refuse_undecodable("dist receiver: payloads travel over the process group")
            return None
        return super()._handle(frames)

    def _open_pair(self, ident: bytes, body: bytes) -> dict:
        try:
            request = json.loads(body)
            sender_id, pid, start = str(request["sender_id"]), int(request["pid"]), int(request["start"])
            backend = group_backend(self.cache.tensor.device, str(request.get("gpu", "")),
                                    device_uuid(self.cache.tensor.device) if self.cache.tensor.is_cuda else "")
        except (ValueError, KeyError, TypeError) as e:
            return {"ok": False, "reason": f"bad pair request: {e!r}"}
        if self._idents.get(sender_id) != ident:
            return {"ok": False, "reason": "pair request before the handshake"}
        if self.auth is not None and not self.auth.handshake_ok(sender_id, str(request.get("proof", ""))):
            # Checked before any group forms: no thread, no store key, no gloo socket for it.
            self.table.count_rejected(f"pair request of {sender_id[:64]!r} without a valid proof")
            return {"ok": False, "reason": "pair request without a valid proof"}
        if sender_id in self._pairs:
            return {"ok": False, "reason": "this sender already has a process group"}
        pair = _Pair(self, sender_id, ident, pid, start, backend)
        self._pairs[sender_id] = self._by_ident[ident] = pair
        log.debug("KV receiver at %s: pairing with sender %s over %s", self._endpoint, sender_id, backend)
        return {"ok": True, "port": self._store.port, "backend": backend, "key": pair.key}

    def _announce(self, ident: bytes, body: memoryview) -> list[bytes] | None:
        pair = self._by_ident.get(ident)
        try:
            header = KVHeader.decode(body)
        except MessageError as e:
            if pair is not None:
                pair.kill(f"undecodable unit header from sender {pair.sender_id}: {e}")
            self.table.refuse_undecodable(str(e))
            return None
        if pair is None or pair.dead:
            # Nothing will receive its tensor. The nack makes the sender collect that send,
            # which fails on the dropped group: it marks its peer failed and is replaced,
            # rather than failing each later transfer on an ack timeout.
            reason = f"no live process group for this sender{': ' + pair.dead if pair else ''}"
            return [ACK, Ack(header.seq, header.transfer_id, header.layer, False, reason).encode()]
        expected = self.layout.payload_nbytes(len(header.block_ids))
        if not 0 < header.payload_nbytes <= self._max_unit_bytes or header.payload_nbytes != expected:
            # Refused before gloo sees the size: no recv is posted for it (see the module doc).
            reason = (f"unit declares {header.payload_nbytes} bytes, not the {expected} of its "
                      f"{len(header.block_ids)} block(s) or outside (0, {self._max_unit_bytes}] "
                      f"(one layer of the cache)")
            pair.kill(reason)
            return [ACK, Ack(header.seq, header.transfer_id, header.layer, False, reason).encode()]
        pair.announce(header)
        return None

    def _on_idle(self) -> None:
        while self._acks:
            ident, ack = self._acks.popleft()
            self._sock.send_multipart([ident, ACK, ack.encode()], flags=zmq.NOBLOCK)
        now = time.monotonic()
        if now >= self._next_fence:
            self._next_fence = now + FENCE_INTERVAL_S
            self._fail_silent_senders(now)  # a tensor still arriving then names a closed transfer
            for sender_id, pair in list(self._pairs.items()):
                if pair.fence is not None and not same_process_alive(*pair.fence):
                    pair.kill(f"sender process {pair.fence[0]} is gone")
                if pair.dead:  # its transfers failed; a live sender reconnects as a new one
                    del self._pairs[sender_id]
                    self._by_ident.pop(pair.ident, None)


class DistSender(ZmqSender):
    backend = "dist"

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 auth: KVAuth | None = None) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s, auth)
        self._group = None
        self._store = None
        self._device = torch.device("cpu")
        # seq -> (the group send's Work, its payload): a gloo send lives only as long as its
        # Work, and only wait() completes it (is_completed() stays False until then).
        self._sending: dict[int, tuple[object, torch.Tensor]] = {}

    def _handshake(self, endpoint: str, layout: KVLayout) -> None:
        deadline = time.monotonic() + self.connect_timeout_s  # for both steps together
        super()._handshake(endpoint, layout)  # zmq's: raises KVLayoutMismatch before any pairing
        try:
            self._join_pair(endpoint, deadline)
        except BaseException:
            self._io_close()  # says goodbye: the receiver drops the half-made pair
            raise

    def _join_pair(self, endpoint: str, deadline: float) -> None:
        assert self._sock is not None
        pid, start = own_identity()
        request = {"sender_id": self.sender_id, "pid": pid, "start": start,
                   "gpu": device_uuid()}  # NCCL needs a GPU on both sides, and two of them
        if self.auth is not None and self.auth.keyed:
            request["proof"] = self.auth.handshake_proof(self.sender_id)
        self._send([PAIR, json.dumps(request).encode()])
        if not self._sock.poll(max(100, int((deadline - time.monotonic()) * 1000))):
            raise KVTransferError(f"no process-group reply from {endpoint} within "
                                  f"{self.connect_timeout_s}s (not a dist receiver?)")
        frames = self._sock.recv_multipart()
        if len(frames) != 2 or frames[0] != PAIRED:
            raise KVTransferError(f"bad process-group reply from {endpoint}")
        reply = json.loads(frames[1])
        if not reply.get("ok"):
            raise KVTransferError(f"receiver at {endpoint} refused the process group: {reply.get('reason')}")
        host, backend = endpoint_host(endpoint), reply.get("backend")
        try:
            if backend == "nccl":  # the receiver's cache is on a GPU: so are the payloads
                self._device = torch.device("cuda", torch.cuda.current_device())
            remaining = max(0.1, deadline - time.monotonic())
            self._store = join_store(host, int(reply["port"]), remaining)
            self._group = pair_group(self._store, str(reply["key"]), SENDER_RANK, backend,
                                     local_address_towards(host), max(0.1, deadline - time.monotonic()))
        except Exception as e:
            raise KVTransferError(f"cannot join the process group of {endpoint}: {e}") from e

    # -- I/O thread -------------------------------------------------------------------------

    def _io_unit_layers(self, layer_nbytes: int) -> int:
        return 1  # one group send per layer (the receiver's handshake says 1 too)

    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        (source,) = sources  # one layer a unit: this transport keeps _io_unit_layers' 1
        idx = torch.tensor(src_ids, dtype=torch.long, device=source.device)
        payload = source.index_select(1, idx).to(self._device).contiguous()
        on_host = payload if payload.device.type == "cpu" else payload.cpu()  # crc32c runs on the host
        header = self.data_header(t, layer, dst_ids, on_host, seq)
        flat = payload.view(torch.uint8).reshape(-1)  # bytes are bytes: bf16 needs no support
        try:
            work = self._group.send([flat], RECEIVER_RANK, TAG)
        except Exception as e:
            self.io.peer_failed(f"process group to {self.endpoint} failed: {e}")
            return f"process group send failed: {e}"
        # The tensor is posted before its header leaves: the receiver, which posts one recv per
        # header, never waits on a tensor that was not sent. `flat` stays alive until reaped.
        self._sending[seq] = (work, flat)
        self._send([TENSOR, header.encode()])
        return ""

    def _io_acked(self, ack: Ack) -> None:
        """The receiver acks a unit only after its recv completed (refused or not), so the
        send is done: collect it (a wait that returns at once) and free the payload."""
        sent = self._sending.pop(ack.seq, None)
        if sent is not None and not self.failed_peer:
            try:
                sent[0].wait(timedelta(seconds=SEND_WAIT_S))
            except Exception as e:
                self.io.peer_failed(f"process group to {self.endpoint} failed: {e}")

    def _io_peer_failed(self, reason: str) -> None:
        self._sending.clear()  # the group is lost with the peer: nothing more completes

    def _io_close(self) -> None:
        super()._io_close()  # the goodbye is handled after every unit already announced
        for work, _ in list(self._sending.values()):  # units still unacknowledged
            if self.failed_peer:
                break
            try:
                work.wait(timedelta(seconds=SEND_WAIT_S))
            except Exception:
                break  # the receiver is gone or stuck: the rest will not complete either
        self._sending.clear()
        self._group = self._store = None
