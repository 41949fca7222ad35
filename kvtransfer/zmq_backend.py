"""ZeroMQ transport: `tcp://host:port` across hosts, `ipc:///path` on one host.

Sockets and frames (the receiver binds a ROUTER, each sender connects a DEALER):

    sender                                   receiver
    [b"H", HandshakeRequest]          --->   (checks nothing; the sender decides)
                                      <---   [b"W", HandshakeReply]  its layout (+ shm names)
    [b"D", KVHeader, payload bytes]   --->   validate, write kv_cache[layer, :, block_ids]
                                      <---   [b"A", Ack]             one per unit (seq)

Zero copy: the payload frame is a memoryview of the contiguous tensor sent with copy=False, so
libzmq reads the tensor's memory directly; the receiver views the received frame as a tensor
and copies it once, into the cache. The sender never blocks: sends are NOBLOCK with no
high-water mark (libzmq's I/O thread does the writing; the payloads are ours anyway), and acks
are drained by poll(). The receiver owns its socket on one background thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Sequence

import torch
import zmq

from .base import KVTransferError, TransferStatus
from .layout import KVCacheBuffer, KVLayout
from .message import (
    Ack, HandshakeReply, KVHeader, MessageError, encode_handshake_request, tensor_bytes,
)
from .receiving import ReceiveTable, TableReceiver
from .sending import TrackedSender

log = logging.getLogger(__name__)

HELLO, WELCOME, DATA, NOTIFY, ACK = b"H", b"W", b"D", b"N", b"A"
_POLL_MS = 50  # receiver thread wake-up for the stop flag; messages wake it at once
_IPC_IDS = itertools.count()


def default_ipc_endpoint(prefix: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"{prefix}-{os.getpid()}-{next(_IPC_IDS)}.sock")
    return f"ipc://{path}"


class ZmqReceiver(TableReceiver):
    def __init__(
        self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:*"
    ) -> None:
        self.cache, self.layout = cache, layout
        self.table = self._make_table()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise KVTransferError(f"cannot bind {endpoint}: {e}") from e
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._closed = False
        # The socket now belongs to the I/O thread; this thread touches it again only after join.
        self._thread = threading.Thread(target=self._serve, name=f"kv-recv {self._endpoint}", daemon=True)
        self._thread.start()

    def _make_table(self) -> ReceiveTable:
        return ReceiveTable(self.cache, self.layout)

    def _handshake_reply(self) -> HandshakeReply:
        return HandshakeReply(self.layout, self.cache.num_blocks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5 * _POLL_MS / 1000 + 5.0)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self._endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass

    # -- I/O thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(_POLL_MS):
                continue
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

    def _handle(self, frames: list[zmq.Frame]) -> list[bytes] | None:
        kind = frames[1].bytes if len(frames) > 1 else b""
        if kind == HELLO:
            return [WELCOME, self._handshake_reply().encode()]
        if (kind, len(frames)) not in ((DATA, 4), (NOTIFY, 3)):
            self.table.refuse_undecodable(f"bad frame kind {kind[:8]!r} or count {len(frames)}")
            return None
        try:
            header = KVHeader.decode(frames[2].buffer)
        except MessageError as e:
            self.table.refuse_undecodable(str(e))
            return None
        data = frames[3].buffer if kind == DATA else None
        return [ACK, self.table.ingest(header, data).encode()]


class ZmqSender(TrackedSender):
    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._backlog: list[list] = []  # frames libzmq refused for now (EAGAIN)
        self.endpoint = ""

    def connect(self, endpoint: str, layout: KVLayout) -> None:
        if self._sock is not None:
            raise KVTransferError(f"already connected to {self.endpoint}")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([HELLO, encode_handshake_request(layout)])
            if not sock.poll(int(self.connect_timeout_s * 1000)):
                raise KVTransferError(f"no handshake reply from {endpoint} within {self.connect_timeout_s}s")
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != WELCOME:
                raise KVTransferError(f"bad handshake reply from {endpoint}")
            reply = HandshakeReply.decode(frames[1])
            self._check_layout(layout, reply.layout, endpoint)
            self._on_handshake(reply, endpoint)
        except BaseException:
            sock.close(linger=0)
            ctx.term()
            raise
        self._ctx, self._sock, self.layout, self.endpoint = ctx, sock, layout, endpoint

    def _on_handshake(self, reply: HandshakeReply, endpoint: str) -> None:
        """Backend-specific use of the reply (shm maps the segment)."""

    def send(self, request_id: str, layer: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        header, payload = self._prepare(request_id, layer, block_ids, payload)
        self._backlog.append(self._frames(header, payload))
        self._flush()

    def _frames(self, header: KVHeader, payload: torch.Tensor) -> list:
        # The memoryview keeps `payload` alive until libzmq has sent it (copy=False).
        return [DATA, header.encode(), tensor_bytes(payload)]

    def poll(self, request_id: str) -> TransferStatus:
        self._flush()
        self._drain_acks()
        return super().poll(request_id)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._backlog.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
        self._sock = self._ctx = None

    def _flush(self) -> None:
        if self._sock is None:
            return
        while self._backlog:
            try:
                self._sock.send_multipart(self._backlog[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._backlog.pop(0)

    def _drain_acks(self) -> None:
        if self._sock is None:
            return
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2 and frames[0] == ACK:
                try:
                    self.tracker.on_ack(Ack.decode(frames[1]))
                except MessageError:
                    continue  # a garbled ack: that unit's deadline will fail it
