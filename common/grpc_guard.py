"""A gRPC server interceptor that answers undecodable protobuf with INVALID_ARGUMENT.

grpc.aio runs a method's request deserializer as part of the handler, so bytes that are not a
valid message of the request type raise DecodeError there: the caller gets UNKNOWN ("Unexpected
error"), and the server logs an ERROR with a traceback for every such request, so any peer
that can reach the port can fill the log. With this interceptor the deserializer's failure
becomes a value the handler never sees: the call ends with INVALID_ARGUMENT naming the
message type, and the server logs nothing.

Every tandem gRPC server installs it (worker nodes, the coordinator's registry and client API,
the gRPC KV receiver). Torch-free and tandem-free: only grpc and protobuf.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    """Stands in for a request that did not decode; the wrapped handler aborts on it."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Malformed(exc)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"undecodable request: {request.error}"[:300])


async def _checked(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            await _refuse(context, request)
        yield request


async def _reject_malformed(request: Any, context) -> None:
    if isinstance(request, _Malformed):
        await _refuse(context, request)


def _unary_in(behavior: Callable, streaming_out: bool,
              screen: Callable[[Any, Any], Awaitable[None]]) -> Callable:
    if not streaming_out:
        async def unary(request: Any, context) -> Any:
            await screen(request, context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        return unary

    async def stream(request: Any, context) -> AsyncIterator[Any]:
        await screen(request, context)
        result = behavior(request, context)
        if inspect.isasyncgen(result):
            async for response in result:
                yield response
        else:  # a coroutine that writes with context.write()
            await result
    return stream


def screened(handler: grpc.RpcMethodHandler, screen: Callable[[Any, Any], Awaitable[None]],
             request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """`handler` (of a unary request) with `screen(request, context)` awaited before the
    method runs; the screen ends the call by aborting (common/cluster_auth.py's proofs).
    `request_deserializer` replaces the handler's own when given."""
    out = handler.response_streaming
    make = grpc.unary_stream_rpc_method_handler if out else grpc.unary_unary_rpc_method_handler
    behavior = handler.unary_stream if out else handler.unary_unary
    return make(_unary_in(behavior, out, screen),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _stream_in(behavior: Callable, streaming_out: bool) -> Callable:
    if not streaming_out:
        async def unary(requests: AsyncIterator[Any], context) -> Any:
            result = behavior(_checked(requests, context), context)
            return await result if inspect.isawaitable(result) else result
        return unary

    async def stream(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
        result = behavior(_checked(requests, context), context)
        if inspect.isasyncgen(result):
            async for response in result:
                yield response
        else:
            await result

    return stream


class RejectMalformed(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        out = handler.response_streaming
        if handler.request_streaming:
            make = (grpc.stream_stream_rpc_method_handler if out
                    else grpc.stream_unary_rpc_method_handler)
            behavior = handler.stream_stream if out else handler.stream_unary
            wrapped = _stream_in(behavior, out)
            return make(wrapped, request_deserializer=_lenient(handler.request_deserializer),
                        response_serializer=handler.response_serializer)
        return screened(handler, _reject_malformed, _lenient(handler.request_deserializer))


def guarded(interceptors: list | tuple | None = None) -> list:
    """`interceptors` with RejectMalformed first, for grpc.aio.server(interceptors=...)."""
    return [RejectMalformed(), *(interceptors or ())]
