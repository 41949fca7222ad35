"""gRPC transport: the fallback that works wherever HTTP/2 does.

    KVTransfer.Handshake(HandshakeRequest) -> HandshakeReply      unary, at connect()
    KVTransfer.Push(stream PushChunk) -> Ack                      one call per transfer unit

A unit's first chunk carries the header; every chunk carries at most CHUNK_BYTES of payload, so
messages stay far below the configured limit whatever the payload size. The sender starts each
call with `.future(...)` and a deadline of ack_timeout_s, so send() returns at once and a dead
receiver surfaces as DEADLINE_EXCEEDED/UNAVAILABLE -> FAILED. The receiver is a threaded
grpc.server; its handler threads share the thread-safe ReceiveTable. Payload bytes are copied
into protobuf messages (unlike zmq); that is the price of the fallback.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import torch

from .base import KVTransferError
from .layout import KVCacheBuffer, KVLayout
from .message import Ack, HandshakeReply, KVHeader, layout_to_pb, tensor_bytes
from .pb import kvtransfer_pb2 as pb
from .pb import kvtransfer_pb2_grpc as pb_grpc
from .receiving import ReceiveTable, TableReceiver
from .sending import TrackedSender

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES  # room for the header and protobuf framing
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: GrpcReceiver) -> None:
        self.receiver = receiver

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeReply:  # noqa: N802
        r = self.receiver
        return HandshakeReply(r.layout, r.cache.num_blocks).to_pb()

    def Push(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> pb.Ack:  # noqa: N802
        table = self.receiver.table
        first = next(request_iterator, None)
        if first is None or not first.HasField("header") or not first.header.request_id:
            table.refuse_undecodable("Push stream without a header")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first PushChunk must carry a header")
        header = KVHeader.from_pb(first.header)
        limit = self.receiver.layout.payload_nbytes(self.receiver.cache.num_blocks)
        parts, total = [first.data], len(first.data)
        for chunk in request_iterator:
            total += len(chunk.data)
            if total > limit:
                return Ack(header.seq, header.request_id, header.layer, False,
                           f"payload exceeds the whole cache ({limit} bytes)").to_pb()
            parts.append(chunk.data)
        return table.ingest(header, b"".join(parts)).to_pb()


class GrpcReceiver(TableReceiver):
    def __init__(
        self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str = "127.0.0.1:0", max_workers: int = 4
    ) -> None:
        self.cache, self.layout = cache, layout
        self.table = ReceiveTable(cache, layout)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_CHANNEL_OPTIONS)
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self), self._server)
        host = endpoint.rsplit(":", 1)[0]
        try:
            port = self._server.add_insecure_port(endpoint)
        except RuntimeError as e:
            raise KVTransferError(f"cannot bind {endpoint}: {e}") from e
        self._endpoint = f"{host}:{port}"
        self._server.start()
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.stop(grace=0).wait(timeout=5.0)


class GrpcSender(TrackedSender):
    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVTransferStub | None = None
        self._calls: set[grpc.Future] = set()

    def connect(self, endpoint: str, layout: KVLayout) -> None:
        if self._channel is not None:
            raise KVTransferError("already connected")
        channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        stub = pb_grpc.KVTransferStub(channel)
        try:
            reply = stub.Handshake(
                pb.HandshakeRequest(layout=layout_to_pb(layout)),
                timeout=self.connect_timeout_s, wait_for_ready=True,
            )
            self._check_layout(layout, HandshakeReply.from_pb(reply).layout, endpoint)
        except grpc.RpcError as e:
            channel.close()
            raise KVTransferError(f"handshake with {endpoint} failed: {e.code().name}: {e.details()}") from e
        except BaseException:
            channel.close()
            raise
        self._channel, self._stub, self.layout = channel, stub, layout

    def send(self, request_id: str, layer: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        header, payload = self._prepare(request_id, layer, block_ids, payload)
        assert self._stub is not None  # _prepare checked connect()
        call = self._stub.Push.future(_chunks(header, payload), timeout=self.tracker.ack_timeout_s)
        self._calls.add(call)
        call.add_done_callback(lambda f, h=header: self._on_done(f, h))

    def _on_done(self, call: grpc.Future, header: KVHeader) -> None:
        # Runs on a gRPC thread; the tracker is thread-safe.
        self._calls.discard(call)
        if call.cancelled():
            self.tracker.fail(header.request_id, "push cancelled (sender closed)")
            return
        error = call.exception()
        if error is not None:
            code = error.code().name if isinstance(error, grpc.Call) else type(error).__name__
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            self.tracker.fail(header.request_id, f"push of layer {header.layer} failed: {code}: {details}")
            return
        self.tracker.on_ack(Ack.from_pb(call.result()))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for call in list(self._calls):
            call.cancel()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _chunks(header: KVHeader, payload: torch.Tensor) -> Iterator[pb.PushChunk]:
    data = tensor_bytes(payload)
    yield pb.PushChunk(header=header.to_pb(), data=bytes(data[:CHUNK_BYTES]))
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield pb.PushChunk(data=bytes(data[start:start + CHUNK_BYTES]))
