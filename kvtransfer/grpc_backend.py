"""gRPC transport: the fallback that works wherever HTTP/2 does.

    KVTransfer.Handshake(HandshakeRequest) -> HandshakeReply   unary, at connect()
    KVTransfer.Grant(GrantRequest) -> GrantReply               long poll: answered when the
                                                               receiver expects the transfer
    KVTransfer.Push(stream PushChunk) -> Ack                   one call per unit: data, finish
                                                               or abort

A unit's first chunk carries the header; every chunk carries at most CHUNK_BYTES of payload, so
messages stay far below the configured limit whatever the payload size. The sender's I/O thread
starts every call with `.future(...)` and a deadline (ack_timeout_s; the grant's remaining
time), and the calls' callbacks post their outcome into its inbox. Push calls run concurrently,
so units may reach the receiver out of order, finish before data: the finish carries the number
of data units, and the receiver completes when all of them are in.

The receiver is a grpc.aio server on one event-loop thread (its I/O thread): a waiting Grant
holds a future, not a thread, so any number of transfers may wait for their expect(). Revocations
have no channel here; none is needed, since the receiver writes every byte itself (RELEASED at
once) and a sender still pushing for a cancelled transfer is refused unit by unit. Payload bytes
are copied into protobuf messages (unlike zmq); that is the price of the fallback.

Authentication (with a KVAuth, kvtransfer/auth.py): the Handshake carries a proof of the secret
in its metadata (refused UNAUTHENTICATED and counted without one, before the layout is told);
every Grant and Push carries its transfer's token and the table drops and counts one without a
valid token before anything else; with TLS
material both sides use mutual TLS, as every other gRPC channel of the internal plane.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import torch

# Torch- and tandem-free: the one gRPC guard every tandem server installs.
from common.grpc_server import bind, new_server

from .auth import HANDSHAKE_PROOF_HEADER, KVAuth
from .base import KVTransferError
from .layout import KVCacheBuffer, KVLayout
from .message import (
    Ack, Grant, GrantRequest, HandshakeReply, HandshakeRequest, KVHeader, MessageError, Revoke,
    tensor_bytes,
)
from .pb import kvtransfer_pb2 as pb
from .pb import kvtransfer_pb2_grpc as pb_grpc
from .receive_table import ReceiveTable
from .receiver import TableReceiver
from .sender import IOSender
from .transfer import OutgoingTransfer

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES  # room for the header and protobuf framing
MAX_LONG_POLL_S = 30.0  # a Grant call answers "pending" after this; the sender asks again
# A Grant call's deadline runs this long past the sender's own grant deadline, and the long poll
# answers "pending" this long before the call's deadline. So the sender's deadline check, not
# gRPC's DEADLINE_EXCEEDED, is what fails a transfer nobody grants, even on a slow host.
GRANT_CALL_GRACE_S = 2.0
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: GrpcReceiver) -> None:
        self.receiver = receiver

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeReply:  # noqa: N802
        r = self.receiver
        try:
            hello = HandshakeRequest.from_pb(request)
        except MessageError as e:  # an invalid layout: the peer's fault, not ours (UNKNOWN)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if r.auth is not None and r.auth.keyed:
            proof = dict(context.invocation_metadata() or ()).get(HANDSHAKE_PROOF_HEADER)
            if not r.auth.handshake_ok(hello.sender_id, proof):
                r.table.count_rejected(f"handshake of {hello.sender_id[:64]!r} without a valid proof")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "KV handshake without a valid proof of the cluster secret")
        r.table.register_sender(hello)
        return HandshakeReply(r.layout, r.cache.num_blocks).to_pb()

    async def Grant(self, request: pb.GrantRequest, context) -> pb.GrantReply:  # noqa: N802
        ask = GrantRequest.from_pb(request)
        r = self.receiver
        if not r.table.authentic(ask.transfer_id, ask.auth_token, "grant request"):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing KV token")
        key = (ask.sender_id, ask.transfer_id)
        waiter = r.loop.create_future()
        r.waiters[key] = waiter
        try:
            r.table.ask(ask.sender_id, ask.transfer_id, ask.auth_token)  # may answer at once
            remaining = context.time_remaining()
            budget = (MAX_LONG_POLL_S if remaining is None
                      else min(MAX_LONG_POLL_S, remaining - GRANT_CALL_GRACE_S))
            try:
                grant = await asyncio.wait_for(waiter, timeout=max(budget, 0.0))
            except asyncio.TimeoutError:
                r.table.withdraw(ask.sender_id, ask.transfer_id)
                grant = Grant(ask.transfer_id, False, "pending")
        finally:
            if r.waiters.get(key) is waiter:
                del r.waiters[key]
        return grant.to_pb()

    async def Push(self, request_iterator: AsyncIterator[pb.PushChunk], context) -> pb.Ack:  # noqa: N802
        table = self.receiver.table
        first = None
        parts: list[bytes] = []
        total = 0
        limit = self.receiver.layout.payload_nbytes(self.receiver.cache.num_blocks)
        async for chunk in request_iterator:
            if first is None:
                first = chunk
                header = first.header
                # Before buffering a byte of a rogue's payload; the table checks again.
                if (self.receiver.auth is not None and self.receiver.auth.keyed and header.transfer_id
                        and not table.authentic(header.transfer_id, header.auth_token, "data unit")):
                    return Ack(header.seq, header.transfer_id, header.layer, False,
                               "unauthenticated unit dropped").to_pb()
            total += len(chunk.data)
            if total > limit:
                header = KVHeader.from_pb(first.header)
                return Ack(header.seq, header.transfer_id, header.layer, False,
                           f"payload exceeds the whole cache ({limit} bytes)").to_pb()
            parts.append(chunk.data)
        if first is None or not first.HasField("header") or not first.header.transfer_id:
            table.refuse_undecodable("Push stream without a header")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first PushChunk must carry a header")
        header = KVHeader.from_pb(first.header)
        if not header.is_data:
            ack = table.control(header)
            return (ack or Ack(header.seq, header.transfer_id, 0, True)).to_pb()
        return table.ingest(header, parts).to_pb()  # the chunks as one stream: no join copy


class GrpcReceiver(TableReceiver):
    def __init__(self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str = "127.0.0.1:0",
                 auth: KVAuth | None = None) -> None:
        self.cache, self.layout, self.auth = cache, layout, auth
        self.table = ReceiveTable(cache, layout, self._deliver, "grpc", auth=auth)
        self.waiters: dict[tuple[str, str], asyncio.Future] = {}  # (sender, transfer) -> grant
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"kv-recv {endpoint}",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(endpoint), self.loop).result(30)
        except BaseException:
            self._stop_loop()
            raise
        self._endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"

    async def _start(self, endpoint: str) -> int:
        self._server = new_server(options=_CHANNEL_OPTIONS)
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self), self._server)
        add_port = self._server.add_insecure_port
        if self.auth is not None and self.auth.tls:
            credentials = grpc.ssl_server_credentials(
                [(self.auth.tls_key, self.auth.tls_cert)], root_certificates=self.auth.tls_ca,
                require_client_auth=True)
            add_port = lambda address: self._server.add_secure_port(address, credentials)  # noqa: E731
        try:
            port = bind(add_port, endpoint, "the gRPC KV receiver")
        except OSError as e:
            raise KVTransferError(str(e)) from e
        await self._server.start()
        return port

    def _deliver(self, sender_id: str, message: Grant | Revoke) -> None:
        if isinstance(message, Grant):  # a Revoke has no channel (see the module docstring)
            self.loop.call_soon_threadsafe(self._resolve, (sender_id, message.transfer_id), message)

    def _resolve(self, key: tuple[str, str], grant: Grant) -> None:
        waiter = self.waiters.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(grant)
        # else the long poll already ended: the sender asks again and is answered again

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self.loop).result(5.0)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self.loop.close()


class GrpcSender(IOSender):
    backend = "grpc"

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 auth: KVAuth | None = None) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s, auth)
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVTransferStub | None = None
        self._calls: set[grpc.Future] = set()

    def _handshake(self, endpoint: str, layout: KVLayout) -> None:
        channel = _channel(endpoint, self.auth)
        stub = pb_grpc.KVTransferStub(channel)
        try:
            keyed = self.auth is not None and self.auth.keyed
            metadata = ((HANDSHAKE_PROOF_HEADER, self.auth.handshake_proof(self.sender_id)),) if keyed else None
            reply = stub.Handshake(
                self._handshake_request(layout).to_pb(), timeout=self.connect_timeout_s,
                wait_for_ready=True, metadata=metadata,
            )
            self._check_layout(layout, HandshakeReply.from_pb(reply).layout, endpoint)
        except grpc.RpcError as e:
            channel.close()
            raise KVTransferError(f"handshake with {endpoint} failed: {e.code().name}: {e.details()}") from e
        except BaseException:
            channel.close()
            raise
        self._channel, self._stub = channel, stub

    # -- I/O thread (callbacks run on gRPC threads and post into the inbox) -------------------

    def _io_ask(self, t: OutgoingTransfer) -> None:
        assert self._stub is not None
        remaining = (t.asked_at or 0.0) + self.ack_timeout_s - time.monotonic()
        ask = GrantRequest(t.transfer_id, self.sender_id, self.token(t.transfer_id))
        call = self._stub.Grant.future(ask.to_pb(),
                                       timeout=max(remaining, 0.01) + GRANT_CALL_GRACE_S)
        self._watch(call, t.transfer_id, "grant request",
                    lambda reply: self.io.post(("grant", Grant.from_pb(reply))))

    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        (source,) = sources  # one layer a unit: this transport keeps _io_unit_layers' 1
        payload = self.gather(source, src_ids)
        header = self.data_header(t, layer, dst_ids, payload, seq)
        self._push(t.transfer_id, header, _chunks(header, payload), f"push of layer {layer}")
        return ""

    def _io_control(self, t: OutgoingTransfer, header: KVHeader) -> None:
        what = "finish" if header.finish else "abort"
        self._push(t.transfer_id, header, iter([pb.PushChunk(header=header.to_pb())]), what)

    def _push(self, transfer_id: str, header: KVHeader, chunks: Iterator[pb.PushChunk], what: str) -> None:
        assert self._stub is not None
        call = self._stub.Push.future(chunks, timeout=self.ack_timeout_s)
        if header.is_abort:  # nobody waits for its answer; keep the call referenced until done
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)
            return
        self._watch(call, transfer_id, what, lambda reply: self.io.post(("ack", Ack.from_pb(reply))))

    def _watch(self, call: grpc.Future, transfer_id: str, what: str, on_reply) -> None:
        self._calls.add(call)

        def done(f: grpc.Future) -> None:
            self._calls.discard(f)
            if f.cancelled():
                return  # close() cancelled it
            error = f.exception()
            if error is None:
                on_reply(f.result())
                return
            code = error.code() if isinstance(error, grpc.Call) else None
            details = error.details() if isinstance(error, grpc.Call) else str(error)
            reason = f"{what} failed: {code.name if code else type(error).__name__}: {details}"
            if code is grpc.StatusCode.UNAVAILABLE:
                self.io.post(("peer_dead", reason))
            else:
                self.io.post(("fail", transfer_id, reason))

        call.add_done_callback(done)

    def _io_close(self) -> None:
        for call in list(self._calls):
            call.cancel()
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


def _channel(endpoint: str, auth: KVAuth | None) -> grpc.Channel:
    if auth is None or not auth.tls:
        return grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
    credentials = grpc.ssl_channel_credentials(root_certificates=auth.tls_ca,
                                               private_key=auth.tls_key, certificate_chain=auth.tls_cert)
    names = [("grpc.ssl_target_name_override", auth.tls_server_name)] if auth.tls_server_name else []
    return grpc.secure_channel(endpoint, credentials, options=_CHANNEL_OPTIONS + names)


def _chunks(header: KVHeader, payload: torch.Tensor) -> Iterator[pb.PushChunk]:
    data = tensor_bytes(payload)
    yield pb.PushChunk(header=header.to_pb(), data=bytes(data[:CHUNK_BYTES]))
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield pb.PushChunk(data=bytes(data[start:start + CHUNK_BYTES]))
