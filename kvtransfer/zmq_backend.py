"""ZeroMQ transport: `tcp://host:port` across hosts, `ipc:///path` on one host.

Sockets and frames (the receiver binds a ROUTER, each sender connects a DEALER; each socket is
owned by one I/O thread, woken by a self-pipe registered in the same zmq.Poller):

    sender                                   receiver
    [H, HandshakeRequest]             --->   remember the sender (id, pid, start time)
                                      <---   [W, HandshakeReply]     its layout (+ shm names)
    [G, GrantRequest]                 --->   at once if expected, else when expect() comes
                                      <---   [g, GrantReply]         skip_blocks, block ids
    [D, KVHeader, payload frames]     --->   validate, write kv_cache[layer, :, ids] + crc32c
                                      <---   [A, Ack]                one per unit (seq)
    [C, KVHeader finish | abort]      --->   finish: COMPLETE when every block is in (acked);
                                             abort: FAILED, RELEASED
                                      <---   [R, Revoke]             cancelled/failed: stop
    [r, Revoked]                      --->   (shm: only now RELEASED)
    [P]  (heartbeat while waiting)    --->
                                      <---   [p]
    [B, sender id]  (closing)         --->   its transfers fail, their blocks are released

Authentication (with a KVAuth, kvtransfer/auth.py): the ROUTER is a CURVE server whose ZAP
handler admits only the cluster's client key, so a peer without the secret never completes a
handshake and no frame of its reaches `_handle`; a socket monitor counts each failed handshake
in the receiver's `auth_rejected`. Every header and grant request also carries its transfer's
token, checked by the table (shm inherits all of this: its control channel is this one).

Copies: a unit's payload leaves as frames that are views of the source blocks themselves, one
per run of consecutive blocks in each layer's K and V (copy=False: libzmq reads the blocks;
the crc32c is one read of them just before, which leaves them in cache for the socket). Only
a unit scattered into many or small runs (MAX_DIRECT_FRAMES) is gathered first, into a reused
staging buffer (payload_pool.py), in one native pass that also computes the crc32c
(SenderHooks.gather_crc). The receiver takes the frames as one byte stream and copies it
into the cache blocks in one native pass that computes the crc32c as it goes
(receive_table.py), so the received bytes are read once. Layers queued together travel as
one unit of up to MAX_UNIT_BYTES (KVHeader.layer_count): one header and one ack for them. No
high-water marks: the payloads are ours anyway, and the engine never waits.

    [D, KVHeader, frame, frame, ...]   the payload: each layer's [2, n, ...] in turn, cut
                                       anywhere into one or more frames
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
import time
from collections import deque

import torch
import zmq

from kernels.copy_crc32c import crc32c_ranges

from .auth import KVAuth
from .base import KVTransferError
from .layout import KVCacheBuffer, KVLayout
from .message import (
    Ack, Grant, GrantRequest, HandshakeReply, HandshakeRequest, KVHeader, MessageError, Revoke,
    Revoked, block_runs, buffer_address, tensor_bytes,
)
from .payload_pool import PayloadPool
from .receive_table import ReceiveTable
from .receiver import TableReceiver
from .sender import IOSender
from .transfer import OutgoingTransfer
from .waker import Waker

log = logging.getLogger(__name__)

HELLO, WELCOME, ASK, GRANT, DATA, NOTIFY, CONTROL, ACK = b"H", b"W", b"G", b"g", b"D", b"N", b"C", b"A"
REVOKE, REVOKED, PING, PONG, BYE = b"R", b"r", b"P", b"p", b"B"
_FENCE_INTERVAL_S = 0.5  # how often the receiver looks for dead same-host senders
_POLL_MS = 100  # receiver thread wake-up when idle (stop flag, fences); messages wake it at once
_IPC_IDS = itertools.count()
_ZAP_DOMAIN = "tandem-kv"
# Every way a peer's handshake can fail: no CURVE, wrong server key, refused client key.
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def default_ipc_endpoint(prefix: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"{prefix}-{os.getpid()}-{next(_IPC_IDS)}.sock")
    return f"ipc://{path}"


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock


# A sender pings every second at most while it has a transfer open (sender_io.py), so this
# much silence from a sender that holds a grant means a cut link or a frozen peer.
SENDER_SILENCE_S = 8.0
POOL_RECHECK_S = 0.0005  # a sender whose staging buffers are all in flight looks again this soon
# The most payload bytes one unit carries when several layers are queued: its staging buffer
# (at most PayloadPool.keep of them in flight) and how long its ack waits for the last byte.
MAX_UNIT_BYTES = 8 << 20
# A unit's payload goes straight from its source blocks as one frame per run of consecutive
# blocks (per layer and K/V) when that takes at most MAX_DIRECT_FRAMES frames of at least
# MIN_DIRECT_FRAME_BYTES each; otherwise it is gathered into one staged frame. The floor is
# pyzmq's copy threshold: a smaller frame would be copied anyway, and copies queued without
# the staging pool's bound could add up to a whole transfer held twice.
MAX_DIRECT_FRAMES = 64
MIN_DIRECT_FRAME_BYTES = zmq.COPY_THRESHOLD


def direct_segments(sources: tuple[torch.Tensor, ...], src_ids: tuple[int, ...]) -> list[memoryview] | None:
    """The unit's payload as views of its sources, one per run of consecutive source blocks in
    each layer's K and V (the payload's order), or None when that would take more than
    MAX_DIRECT_FRAMES frames or one under MIN_DIRECT_FRAME_BYTES (scattered blocks: one staged
    frame is cheaper than many small ones), or a source is not a contiguous host tensor."""
    if any(s.device.type != "cpu" or not s.is_contiguous() for s in sources):
        return None
    runs = list(block_runs(src_ids))
    block_bytes = sources[0][0, 0].numel() * sources[0].element_size()
    if 2 * len(sources) * len(runs) > MAX_DIRECT_FRAMES or \
            min(length for _, _, length in runs) * block_bytes < MIN_DIRECT_FRAME_BYTES:
        return None
    views = []
    for source in sources:
        raw = tensor_bytes(source)  # [2, num_blocks, ...] of one layer
        for kv in (0, 1):
            at = kv * source.shape[1]
            views += [raw[(at + start) * block_bytes:(at + start + length) * block_bytes]
                      for start, _, length in runs]
    return views


class ZmqReceiver(TableReceiver):
    one_sided = False
    multi_layer_units = True  # advertised in the handshake (HandshakeReply.max_unit_layers)

    def __init__(
        self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:*",
        auth: KVAuth | None = None, sender_silence_s: float = SENDER_SILENCE_S,
    ) -> None:
        if not sender_silence_s > 0:
            raise ValueError(f"sender_silence_s must be positive, got {sender_silence_s!r}")
        self.cache, self.layout, self.auth = cache, layout, auth
        self.sender_silence_s = sender_silence_s
        self.table = self._make_table()
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, zmq.ROUTER)
        self._zap = self._monitor = None
        try:
            if auth is not None and auth.keyed:
                self._secure(auth)
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise KVTransferError(f"cannot bind {endpoint}: {e}") from e
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox: deque[tuple[str, Grant | Revoke]] = deque()  # from any thread
        self._waker = Waker()
        self._idents: dict[str, bytes] = {}  # sender id -> zmq routing id (I/O thread)
        self._heard: dict[bytes, float] = {}  # routing id -> when its last frame came (I/O thread)
        self._stop = threading.Event()
        self._closed = False
        # The socket now belongs to the I/O thread; this thread touches it again only after join.
        self._thread = threading.Thread(target=self._serve, name=f"kv-recv {self._endpoint}", daemon=True)
        self._thread.start()

    def _make_table(self) -> ReceiveTable:
        return ReceiveTable(self.cache, self.layout, self._deliver, "zmq", auth=self.auth)

    def _secure(self, auth: KVAuth) -> None:
        """CURVE server, ZAP admitting only the cluster's client key, a monitor for failures."""
        from zmq.auth.thread import ThreadAuthenticator  # noqa: PLC0415

        public, secret = auth.curve_server()
        client_key = auth.curve_client()[0]
        table = self.table

        class OnlyCluster:  # ZAP's credentials provider: called with each client's public key
            def callback(self, domain: str, key: bytes) -> bool:
                ok = key == client_key  # z85 text of a public key: not a secret
                if not ok:
                    table.count_rejected("CURVE client key is not the cluster's")
                return ok

        self._zap = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
        self._zap.start()
        self._zap.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=OnlyCluster())
        self._sock.curve_server = True
        self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
        self._sock.zap_domain = _ZAP_DOMAIN.encode()
        self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)

    def _close_sockets(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()

    def _drain_monitor(self) -> None:
        """I/O thread: count failed handshakes (ZAP refusals are counted by the provider)."""
        from zmq.utils.monitor import recv_monitor_message  # noqa: PLC0415

        while True:
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # ZAP's, counted already
                self.table.count_rejected(f"KV handshake failed from {event['endpoint']!r}: "
                                          f"{zmq.strerror(event['value'])}")

    def _handshake_reply(self) -> HandshakeReply:
        return HandshakeReply(self.layout, self.cache.num_blocks,
                              max_unit_layers=self.layout.num_layers if self.multi_layer_units else 1)

    def _deliver(self, sender_id: str, message: Grant | Revoke) -> None:
        """Called by the table (any thread, its lock held): hand the frame to the I/O thread."""
        self._outbox.append((sender_id, message))
        self._waker.wake()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._waker.wake()
        self._thread.join(timeout=5.0)
        self._close_sockets()
        self._waker.close()
        if self._endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self._endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass

    # -- I/O thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            poller.poll(_POLL_MS)
            self._waker.drain()
            if self._monitor is not None:
                self._drain_monitor()
            self._flush_outbox()
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    reply = self._handle(frames)
                except Exception as e:  # a bug here must not kill the receiver silently
                    log.exception("KV receiver at %s failed on a message", self._endpoint)
                    self.table.refuse_undecodable(f"internal error: {e!r}")
                    continue
                if reply is not None:
                    sock.send_multipart([frames[0].bytes, *reply], flags=zmq.NOBLOCK)
                self._flush_outbox()  # grants given while handling come out in order
            self._on_idle()

    def _on_idle(self) -> None:
        """Once per loop, at most every _FENCE_INTERVAL_S: fail the transfers of a same-host
        sender whose process died. kill -9 sends no goodbye, so without this its granted
        transfers would wait out their whole deadline (kv-deadline, 330 s by default) holding
        their blocks. A sender on another host is not visible here (fence.py): its deadline
        stays the bound."""
        now = time.monotonic()
        if now >= getattr(self, "_next_fence", 0.0):
            self._next_fence = now + _FENCE_INTERVAL_S
            self.table.check_fences()
            if not self.table.one_sided:
                self._fail_silent_senders(now)

    def _fail_silent_senders(self, now: float) -> None:
        """Fails the transfers granted to senders silent for sender_silence_s (a cut link, a
        frozen or vanished host: no goodbye comes, and the fence sees only this host's
        processes), so the coordinator places them again instead of waiting out kv-deadline.
        Only where this receiver does every write itself (zmq, dist): their blocks are free
        at once, since a frame that arrives later names a closed transfer and is refused. An
        shm writer may still be writing while silent, so shm keeps its own rule."""
        def silent(sender_id: str) -> bool:
            ident = self._idents.get(sender_id)
            return ident is not None and now - self._heard.get(ident, now) > self.sender_silence_s

        self.table.fail_silent(silent, f"sender silent for over {self.sender_silence_s:.0f}s "
                                       "(link cut or peer frozen)")

    def _flush_outbox(self) -> None:
        while self._outbox:
            sender_id, message = self._outbox.popleft()
            ident = self._idents.get(sender_id)
            if ident is None:
                log.warning("KV receiver at %s: no route to sender %s", self._endpoint, sender_id)
                continue
            kind = GRANT if isinstance(message, Grant) else REVOKE
            self._sock.send_multipart([ident, kind, message.encode()], flags=zmq.NOBLOCK)

    def _handle(self, frames: list[zmq.Frame]) -> list[bytes] | None:
        ident = frames[0].bytes
        self._heard[ident] = time.monotonic()
        kind = frames[1].bytes if len(frames) > 1 else b""
        try:
            if kind == HELLO and len(frames) == 3:
                request = HandshakeRequest.decode(frames[2].buffer)
                self._idents[request.sender_id] = ident
                self.table.register_sender(request)
                return [WELCOME, self._handshake_reply().encode()]
            if kind == PING:
                return [PONG]
            if kind == ASK and len(frames) == 3:
                ask = GrantRequest.decode(frames[2].buffer)
                self._idents[ask.sender_id] = ident
                self.table.ask(ask.sender_id, ask.transfer_id, ask.auth_token)
                return None
            if kind == REVOKED and len(frames) == 3:
                done = Revoked.decode(frames[2].buffer)
                self.table.revoked(done.sender_id, done.transfer_id)
                return None
            if kind == BYE and len(frames) == 3:
                self._heard.pop(ident, None)
                self.table.sender_gone(frames[2].bytes.decode(), "sender closed")
                return None
            if not ((kind == DATA and len(frames) >= 4) or (kind in (NOTIFY, CONTROL) and len(frames) == 3)):
                self.table.refuse_undecodable(f"bad frame kind {kind[:8]!r} or count {len(frames)}")
                return None
            header = KVHeader.decode(frames[2].buffer)
        except MessageError as e:
            self.table.refuse_undecodable(str(e))
            return None
        if kind == CONTROL:
            ack = self.table.control(header)
            return None if ack is None else [ACK, ack.encode()]
        data = [frame.buffer for frame in frames[3:]] if kind == DATA else None
        return [ACK, self.table.ingest(header, data).encode()]


class ZmqSender(IOSender):
    backend = "zmq"
    heartbeat = True

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 auth: KVAuth | None = None) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s, auth)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._poller: zmq.Poller | None = None
        self._pool = PayloadPool()  # staging buffers of DATA frames (I/O thread)
        self._max_unit_layers = 1  # layers a unit may carry, from the receiver's handshake

    def _handshake(self, endpoint: str, layout: KVLayout) -> None:
        ctx = zmq.Context()
        sock = _socket(ctx, zmq.DEALER)
        try:
            if self.auth is not None and self.auth.keyed:
                sock.curve_serverkey = self.auth.curve_server()[0]
                sock.curve_publickey, sock.curve_secretkey = self.auth.curve_client()
            sock.connect(endpoint)
            sock.send_multipart([HELLO, self._handshake_request(layout).encode()])
            if not sock.poll(int(self.connect_timeout_s * 1000)):
                hint = " (or its cluster secret differs from ours)" if self.auth and self.auth.keyed else ""
                raise KVTransferError(f"no handshake reply from {endpoint} within "
                                      f"{self.connect_timeout_s}s{hint}")
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != WELCOME:
                raise KVTransferError(f"bad handshake reply from {endpoint}")
            reply = HandshakeReply.decode(frames[1])
            self._check_layout(layout, reply.layout, endpoint)
            self._max_unit_layers = reply.max_unit_layers
            self._on_handshake(reply, endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            raise
        self._ctx, self._sock = ctx, sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._waker.fd, zmq.POLLIN)

    def _on_handshake(self, reply: HandshakeReply, endpoint: str) -> None:
        """Backend-specific use of the reply (shm maps the segment)."""

    # -- I/O thread -------------------------------------------------------------------------

    def _io_wait(self, timeout: float) -> None:
        assert self._poller is not None and self._sock is not None
        self._poller.poll(int(timeout * 1000) if timeout > 0 else 0)
        self._waker.drain()
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.io.heard()
            try:
                self._dispatch(frames)
            except MessageError as e:
                log.warning("garbled message from %s: %s", self.endpoint, e)  # its deadline fails it

    def _dispatch(self, frames: list[bytes]) -> None:
        kind = frames[0]
        if kind == ACK and len(frames) == 2:
            self.io.on_ack(Ack.decode(frames[1]))
        elif kind == GRANT and len(frames) == 2:
            self.io.on_grant(Grant.decode(frames[1]))
        elif kind == REVOKE and len(frames) == 2:
            self.io.on_revoke(Revoke.decode(frames[1]))
        elif kind != PONG:
            log.warning("unexpected frame %r from %s", kind[:8], self.endpoint)

    def _send(self, frames: list, copy: bool = True) -> None:
        assert self._sock is not None
        self._sock.send_multipart(frames, copy=copy)  # no HWM: never blocks

    def _io_ask(self, t: OutgoingTransfer) -> None:
        self._send([ASK, GrantRequest(t.transfer_id, self.sender_id, self.token(t.transfer_id)).encode()])

    def _io_unit_layers(self, layer_nbytes: int) -> int:
        return max(1, min(self._max_unit_layers, MAX_UNIT_BYTES // max(1, layer_nbytes)))

    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        assert self.layout is not None and self._sock is not None  # set by connect()
        segments = direct_segments(sources, src_ids)
        if segments is not None:
            # Zero copy: libzmq reads the source blocks themselves, which stay put until the
            # transfer is terminal (the connector's block rule: sent blocks are never written
            # again, and the engine frees them only after poll() reports the end), and each
            # frame keeps its tensor alive. The crc32c is one read of the same bytes, which
            # leaves them in cache for the socket's copy.
            crc = crc32c_ranges([(buffer_address(view), view.nbytes) for view in segments])
            header = self.data_header(t, layer, dst_ids, None, seq, crc=crc, layer_count=len(sources))
            self._sock.send_multipart([DATA, header.encode(), *segments], copy=False)
            return ""
        nbytes = len(sources) * self.layout.payload_nbytes(len(dst_ids))
        buffer = self._pool.take(nbytes)
        assert buffer is not None  # _io_can_transmit said so, and nothing took one since
        try:
            payload = buffer[:nbytes]
            crc = self.gather_crc(sources, src_ids, payload)
            header = self.data_header(t, layer, dst_ids, None, seq, crc=crc, layer_count=len(sources))
            # copy=False: libzmq reads the staging buffer itself; the tracker says when it is
            # done, and only then does the pool hand the buffer out again.
            tracker = self._sock.send_multipart([DATA, header.encode(), tensor_bytes(payload)],
                                                copy=False, track=True)
        except BaseException:
            self._pool.release(buffer)
            raise
        self._pool.sent(buffer, lambda: tracker.done)
        return ""

    def _io_can_transmit(self) -> bool:
        return self._pool.has_free()

    def _io_next_due(self) -> float | None:
        # Staging buffers come free when libzmq has written them to the socket, which wakes
        # nothing here: look again soon while they are all in flight.
        return None if self._pool.has_free() else time.monotonic() + POOL_RECHECK_S

    def _io_control(self, t: OutgoingTransfer, header: KVHeader) -> None:
        self._send([CONTROL, header.encode()])

    def _io_revoked(self, transfer_id: str) -> None:
        self._send([REVOKED, Revoked(transfer_id, self.sender_id).encode()])

    def _io_ping(self) -> None:
        self._send([PING])

    def _io_close(self) -> None:
        sock, ctx = self._sock, self._ctx
        self._sock = self._ctx = self._poller = None
        self._pool.drop()
        if sock is None or ctx is None:
            return
        try:
            sock.send_multipart([BYE, self.sender_id.encode()], flags=zmq.NOBLOCK)
            sock.close(linger=200)  # libzmq's I/O thread sends the goodbye within the linger
        finally:
            ctx.term()
