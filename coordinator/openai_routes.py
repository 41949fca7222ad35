"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (SSE streams ending with
`data: [DONE]`, or one JSON object, both with usage), /v1/models (the table is
coordinator/routes.py). Parsing and shapes are in openai_api.py; a chat completion is admitted
by Ollama's chat (OllamaRoutes.start_chat), and admission, limits and cancellation are shared
with the Ollama routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from coordinator.access import request_salt
from coordinator import openai_api as oa
from coordinator.generation import Generation
from coordinator.http_stream import SSE, WatchedStream, collect, read_json_body
from coordinator.logprobs import join_completion_logprobs
from coordinator.metrics import RequestTimings
from coordinator.ollama_routes import OllamaRoutes
from coordinator.prompts import completion_prompt_ids, off_loop
from coordinator.request_flow import WorkerError
from coordinator.service import Coordinator
from coordinator.thinking import ThinkSplitter, opens_thinking, split_thinking
from coordinator.tool_calls import ToolCallParser, call_format, openai_tool_calls


def _usage(g: Generation) -> dict[str, Any]:
    t = g.timings
    return oa.usage(t.prompt_tokens, t.output_tokens, g.outcome.cached_tokens)


def _chat_logprobs(g: Generation) -> list[dict[str, Any]] | None:
    """The content entries since the last chunk (coordinator/logprobs.py), None if not asked."""
    return g.take_logprobs() if g.wants_logprobs else None


class OpenAIRoutes:
    """OpenAI's routes; chat completions is an adapter over Ollama's chat (`start_chat`)."""

    def __init__(self, coordinator: Coordinator, ollama: OllamaRoutes) -> None:
        self.coordinator = coordinator
        self.ollama = ollama
        self.limits = coordinator.config
        # Each served model's file time, as OpenAI's `created`, read once at start.
        self.created = {m.fingerprint: int(m.path.stat().st_mtime) for m in coordinator.models}

    async def models(self) -> JSONResponse:
        return JSONResponse(oa.models_list([(m.listed_name, self.created[m.fingerprint])
                                            for m in self.coordinator.models]))

    async def one_model(self, name: str) -> JSONResponse:
        model = self.coordinator.models.get(name)
        return JSONResponse(oa.model_entry(model.listed_name, self.created[model.fingerprint]))

    async def chat_completions(self, request: Request) -> Response:
        timings = RequestTimings()
        req = oa.parse_chat_completion(await read_json_body(request, self.limits.max_body_bytes),
                                       self.limits.max_messages)
        generation = await self.ollama.start_chat(req.model, req.messages, req.tools,
                                                  req.params, timings,
                                                  cache_salt=request_salt(request, req.cache_salt),
                                                  think=req.think)
        rid = oa.new_id("chatcmpl")
        # Tools (coordinator/tool_calls.py): the output is parsed into tool_calls; a forced
        # tool_choice makes the whole output the call.
        model = self.coordinator.models.get(req.model)
        template = model.tokenizer.chat_template
        calls = (ToolCallParser(call_format(template), req.tools or [], req.tool_choice)
                 if req.tools or req.tool_choice.forced else None)
        # reasoning_effort on: the <think> block is reasoning_content (coordinator/thinking.py).
        thinking = (ThinkSplitter(started=opens_thinking(model.tokenizer, generation))
                    if req.think else None)
        if req.stream:
            return WatchedStream(_stream_chat(rid, req.model, generation, req.include_usage,
                                              calls, thinking),
                                 generation.close, media_type=SSE)
        content = await collect(request, generation)
        if content is None:
            return Response(status_code=499)
        reasoning = None
        if thinking is not None:
            reasoning, content = thinking.split(content)
        found = []
        if calls is not None:
            content, found = calls.split(content)
        return JSONResponse(oa.chat_completion(rid, req.model, content, generation.done_reason,
                                               _usage(generation), found,
                                               _chat_logprobs(generation), reasoning))

    async def completions(self, request: Request) -> Response:
        timings = RequestTimings()
        req = oa.parse_completion(await read_json_body(request, self.limits.max_body_bytes))
        model = self.coordinator.models.get(req.model)
        prompt_ids = await off_loop(completion_prompt_ids, model, req.prompt,
                                    req.params.context_limit(model.context_len))
        generation = await self.coordinator.submit(prompt_ids, req.params, timings,
                                                   cache_salt=request_salt(request, req.cache_salt),
                                                   model=model)
        rid = oa.new_id("cmpl")
        echo = _Echo(req, prompt_ids, model.tokenizer) if req.echo else None
        if req.stream:
            return WatchedStream(_stream_completion(rid, req.model, generation,
                                                    req.include_usage, echo),
                                 generation.close, media_type=SSE)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        if echo is None:
            logprobs = (generation.take_completion_logprobs(0) if generation.wants_logprobs
                        else None)
            return JSONResponse(oa.completion(rid, req.model, text, generation.done_reason,
                                              _usage(generation), logprobs=logprobs))
        text, logprobs = echo.whole(generation, text)
        return JSONResponse(oa.completion(rid, req.model, text, echo.reason(generation),
                                          echo.usage(generation), logprobs=logprobs))


class _Echo:
    """Completions' echo (openai_api.py): the prompt's text and, when logprobs were asked
    for, its tokens' entries come first; score_only (max_tokens 0) drops the one token
    generated."""

    def __init__(self, req: oa.OpenAIRequest, prompt_ids: list[int], tokenizer) -> None:
        self.prompt_ids = prompt_ids
        self.text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(prompt_ids)
        self.score_only = req.score_only

    def prompt_logprobs(self, g: Generation) -> dict[str, Any] | None:
        return g.prompt_completion_logprobs(self.prompt_ids) if g.wants_logprobs else None

    def whole(self, g: Generation, text: str) -> tuple[str, dict[str, Any] | None]:
        if self.score_only:
            return self.text, self.prompt_logprobs(g)
        if not g.wants_logprobs:
            return self.text + text, None
        return self.text + text, join_completion_logprobs(
            self.prompt_logprobs(g), g.take_completion_logprobs(len(self.text)))

    def reason(self, g: Generation) -> str | None:
        return "length" if self.score_only else g.done_reason

    def usage(self, g: Generation) -> dict[str, Any]:
        if not self.score_only:
            return _usage(g)
        return oa.usage(g.timings.prompt_tokens, 0, g.outcome.cached_tokens)


async def _stream_chat(rid: str, name: str, g: Generation, include_usage: bool,
                       calls: ToolCallParser | None = None,
                       thinking: ThinkSplitter | None = None) -> AsyncIterator[bytes]:
    made = 0  # tool calls sent so far (their indexes)

    def chunks(content: str, found: list) -> list[bytes]:
        nonlocal made
        out = ([oa.sse(oa.chat_chunk(rid, name, {"content": content},
                                     logprobs=_chat_logprobs(g)))] if content else [])
        if found:  # each call whole in one delta, as vLLM's parsers send a finished call
            out.append(oa.sse(oa.chat_chunk(
                rid, name, {"tool_calls": openai_tool_calls(found, first_index=made)})))
            made += len(found)
        return out

    yield oa.sse(oa.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
    try:
        async for thought, content, found in split_thinking(g.pieces(), thinking, calls):
            if thought:  # vLLM's delta for reasoning
                yield oa.sse(oa.chat_chunk(rid, name, {"reasoning_content": thought}))
            for chunk in chunks(content, found):
                yield chunk
    except WorkerError as exc:
        yield oa.sse(oa.error_body(500, str(exc)))
        return
    reason = "tool_calls" if made else g.done_reason
    yield oa.sse(oa.chat_chunk(rid, name, {}, reason, done=True, logprobs=_chat_logprobs(g)))
    if include_usage:
        yield oa.sse(oa.usage_chunk(rid, name, "chat.completion.chunk", _usage(g)))
    yield oa.sse("[DONE]")


async def _stream_completion(rid: str, name: str, g: Generation, include_usage: bool,
                             echo: _Echo | None = None) -> AsyncIterator[bytes]:
    offset = 0  # characters sent so far: where the next chunk's text_offset starts

    def logprobs() -> dict[str, Any] | None:
        return g.take_completion_logprobs(offset) if g.wants_logprobs else None

    def echoed() -> bytes:
        # The prompt's chunk: its logprobs come with the first token, so it goes out once
        # that arrived (before the first piece, or at the end).
        nonlocal offset, echo
        chunk = oa.sse(oa.completion(rid, name, echo.text, None, None, done=False, chunk=True,
                                     logprobs=echo.prompt_logprobs(g)))
        offset, echo = len(echo.text), None
        return chunk

    score_only = echo is not None and echo.score_only
    try:
        async for piece in g.pieces():
            if echo is not None and not score_only:
                yield echoed()
            if score_only:
                continue
            yield oa.sse(oa.completion(rid, name, piece, None, None, done=False, chunk=True,
                                       logprobs=logprobs()))
            offset += len(piece)
    except WorkerError as exc:
        yield oa.sse(oa.error_body(500, str(exc)))
        return
    if echo is not None:
        yield echoed()
    reason = "length" if score_only else g.done_reason
    yield oa.sse(oa.completion(rid, name, "", reason, None, chunk=True,
                               logprobs=None if score_only else logprobs()))
    if include_usage:
        usage = (oa.usage(g.timings.prompt_tokens, 0, g.outcome.cached_tokens) if score_only
                 else _usage(g))
        yield oa.sse(oa.usage_chunk(rid, name, "text_completion", usage))
    yield oa.sse("[DONE]")
