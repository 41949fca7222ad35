"""HTTP plumbing shared by the Ollama and OpenAI routes: a bounded body reader, a streaming
response that notices the client leaving, and the same for non-streamed answers.

A client that disconnects has its request cancelled on every worker: the streaming response
watches `http.disconnect` while it waits for the next token and always runs `on_close`
(Generation.close, which cancels the worker streams and frees the admission slot).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.ollama_request import RequestError, parse_json_body

if TYPE_CHECKING:
    from coordinator.generation import Generation

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes, before reading it all if the client
    announced its length."""
    too_large = RequestError(f"request body too large: the limit is {limit} bytes", 413)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


class WatchedStream(StreamingResponse):
    """A stream that watches for the client leaving while it waits for the next piece, whatever
    ASGI spec version the server announces, and always runs `on_close` afterwards."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 media_type: str = NDJSON) -> None:
        headers = {"Cache-Control": "no-cache"} if media_type == SSE else None
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (non-streamed answers)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


async def collect(request: Request, generation: Generation) -> str | None:
    """The whole answer, or None if the client left first (the request is then cancelled)."""
    async def run() -> str:
        return "".join([piece async for piece in generation.pieces()])

    try:
        return await until_disconnected(request, run())
    except ClientGone:
        return None
    finally:
        await generation.close()
