"""The HTTP front door (FastAPI): Ollama's API for now; the OpenAI surface joins it later.

Routes stay thin: parse (ollama_request) -> tokenize and admit (Coordinator) -> shape
(ollama_response). Errors before any output are a status with {"error": ...}; errors after
the stream started are a last NDJSON line {"error": ...}. A client that disconnects has its
request cancelled on every worker (NDJSONResponse and _until_disconnected below).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.admission import Overloaded
from coordinator.generation import Generation
from coordinator.metrics import RequestTimings
from coordinator.ollama_request import RequestError, parse_chat, parse_json_body
from coordinator.ollama_response import (
    chat_chunk, chat_final, chat_load, error_body, ndjson,
)
from coordinator.request_flow import NoWorkers, WorkerError
from coordinator.service import Coordinator
from engine.errors import ModelNotFoundError, TandemError

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


class NDJSONResponse(StreamingResponse):
    """A stream that watches for the client leaving while it waits for the next token, whatever
    ASGI spec version the server announces, and always runs `on_close` afterwards."""

    media_type = NDJSON

    def __init__(self, content: AsyncIterator[bytes],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content)
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


class _ClientGone(Exception):
    pass


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
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
            raise _ClientGone()
    return task.result()


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status, headers=headers)


def create_app(coordinator: Coordinator, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="tandem", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    model = coordinator.model

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return _error(503, str(exc), {"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(NoWorkers)
    async def _no_workers(_: Request, exc: NoWorkers) -> JSONResponse:
        return _error(503, str(exc), {"Retry-After": str(coordinator.config.retry_after_s)})

    @app.exception_handler(ModelNotFoundError)
    async def _not_found(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(TandemError)
    async def _user_error(_: Request, exc: TandemError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(WorkerError)
    async def _worker_error(_: Request, exc: WorkerError) -> JSONResponse:
        return _error(500, str(exc))

    @app.exception_handler(Exception)
    async def _fault(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/")
    @app.head("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(coordinator.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/internal/workers")
    async def workers() -> JSONResponse:
        return JSONResponse(coordinator.workers_report())

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        timings = RequestTimings()
        chat_req = parse_chat(parse_json_body(await request.body()))
        if not model.answers_to(chat_req.model):
            raise ModelNotFoundError(f"model '{chat_req.model}' not found")
        if not chat_req.messages:
            return JSONResponse(chat_load(model.name))
        tokenizer = model.tokenizer
        prompt = tokenizer.apply_chat_template(chat_req.messages, add_generation_prompt=True,
                                               tools=chat_req.tools)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        timings.prompt_tokens = len(prompt_ids)
        flow_req = coordinator.prepare(prompt_ids, chat_req.params)
        generation = await coordinator.begin(flow_req, timings)
        if chat_req.stream:
            return NDJSONResponse(_stream_chat(model.name, generation), generation.close)
        try:
            content = await _until_disconnected(request, _collect(generation))
            return JSONResponse(chat_final(model.name, generation, content))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            await generation.close()

    return app


async def _collect(generation: Generation) -> str:
    return "".join([piece async for piece in generation.pieces()])


async def _stream_chat(name: str, generation: Generation) -> AsyncIterator[bytes]:
    try:
        async for piece in generation.pieces():
            yield ndjson(chat_chunk(name, piece))
    except WorkerError as exc:
        yield ndjson(error_body(str(exc)))
        return
    yield ndjson(chat_final(name, generation))
