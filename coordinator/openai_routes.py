"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (SSE streams ending with
`data: [DONE]`, or one JSON object, both with usage), /v1/models. Parsing and shapes are in
openai_api.py; admission, limits and cancellation are shared with the Ollama routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from coordinator import openai_api as oa
from coordinator.generation import Generation
from coordinator.http_stream import SSE, WatchedStream, read_json_body
from coordinator.metrics import RequestTimings
from coordinator.model import shown
from coordinator.prompts import chat_prompt_ids, completion_prompt_ids, off_loop
from coordinator.request_flow import WorkerError
from coordinator.service import Coordinator
from engine.errors import ModelNotFoundError


def _usage(g: Generation) -> dict[str, Any]:
    t = g.timings
    return oa.usage(t.prompt_tokens, t.output_tokens, g.outcome.cached_tokens)


def add_openai_routes(app: FastAPI, coordinator: Coordinator, collect: Callable,
                      check_model: Callable) -> None:
    model = coordinator.model
    limits = coordinator.config
    created = int(model.path.stat().st_mtime)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(oa.models_list(model.name, created))

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> JSONResponse:
        if not model.answers_to(name):
            raise ModelNotFoundError(f"model '{shown(name)}' not found")
        return JSONResponse(oa.model_entry(model.name, created))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        timings = RequestTimings()
        req = oa.parse_chat_completion(await read_json_body(request, limits.max_body_bytes),
                                       limits.max_messages)
        check_model(coordinator, req.model)
        prompt_ids = await off_loop(chat_prompt_ids, model, req.messages, req.tools,
                                    req.params.context_limit(model.context_len))
        generation = await coordinator.submit(prompt_ids, req.params, timings)
        rid = oa.new_id("chatcmpl")
        if req.stream:
            return WatchedStream(_stream_chat(rid, req.model, generation, req.include_usage),
                                 generation.close, media_type=SSE)
        content = await collect(request, generation)
        if content is None:
            return Response(status_code=499)
        return JSONResponse(oa.chat_completion(rid, req.model, content, generation.done_reason,
                                               _usage(generation)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        timings = RequestTimings()
        req = oa.parse_completion(await read_json_body(request, limits.max_body_bytes))
        check_model(coordinator, req.model)
        prompt_ids = await off_loop(completion_prompt_ids, model, req.prompt,
                                    req.params.context_limit(model.context_len))
        generation = await coordinator.submit(prompt_ids, req.params, timings)
        rid = oa.new_id("cmpl")
        if req.stream:
            return WatchedStream(_stream_completion(rid, req.model, generation,
                                                    req.include_usage),
                                 generation.close, media_type=SSE)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        return JSONResponse(oa.completion(rid, req.model, text, generation.done_reason,
                                          _usage(generation)))


async def _stream_chat(rid: str, name: str, g: Generation,
                       include_usage: bool) -> AsyncIterator[bytes]:
    yield oa.sse(oa.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
    try:
        async for piece in g.pieces():
            yield oa.sse(oa.chat_chunk(rid, name, {"content": piece}))
    except WorkerError as exc:
        yield oa.sse(oa.error_body(500, str(exc)))
        return
    yield oa.sse(oa.chat_chunk(rid, name, {}, g.done_reason, done=True))
    if include_usage:
        yield oa.sse(oa.usage_chunk(rid, name, "chat.completion.chunk", _usage(g)))
    yield oa.sse("[DONE]")


async def _stream_completion(rid: str, name: str, g: Generation,
                             include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async for piece in g.pieces():
            yield oa.sse(oa.completion(rid, name, piece, None, None, done=False, chunk=True))
    except WorkerError as exc:
        yield oa.sse(oa.error_body(500, str(exc)))
        return
    yield oa.sse(oa.completion(rid, name, "", g.done_reason, None, chunk=True))
    if include_usage:
        yield oa.sse(oa.usage_chunk(rid, name, "text_completion", _usage(g)))
    yield oa.sse("[DONE]")
