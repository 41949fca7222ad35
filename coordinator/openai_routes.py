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
from coordinator.choices import Choice, close_all, merged, submit_choices
from coordinator.choices import usage as choice_usage
from coordinator.http_stream import (
    SSE, ClientGone, WatchedStream, read_json_body, until_disconnected,
)
from coordinator.logprobs import join_completion_logprobs
from coordinator.metrics import RequestTimings
from coordinator.model import ServedModel
from coordinator.ollama_routes import OllamaRoutes
from coordinator.prompts import completion_prompt_ids, off_loop
from coordinator.request_flow import WorkerError
from coordinator.response_cache import cache_state, last_user_text
from coordinator.service import Coordinator
from coordinator.thinking import ThinkSplitter, opens_thinking, split_thinking
from coordinator.tool_calls import ToolCallParser, call_format, openai_tool_calls


def _usage(choices: list[Choice], score_only: bool = False) -> dict[str, Any]:
    """Summed over the choices (coordinator/choices.py); score_only: no completion tokens."""
    prompt, completion, cached = choice_usage(choices)
    return oa.usage(prompt, 0 if score_only else completion, cached)


def _chunk_marked(body: dict[str, Any], g: Generation) -> dict[str, Any]:
    """`tandem.cache` of one choice on its stream's finishing chunk, when the cache is on."""
    if g.cache is not None:
        body["tandem"] = {"cache": g.cache}
    return body


def _cache_marked(body: dict[str, Any], choices: list[Choice]) -> dict[str, Any]:
    """`tandem.cache` (coordinator/response_cache.py) on a whole answer, when the cache is on;
    streams carry it in the X-Tandem-Cache header and each choice's finishing chunk."""
    state = cache_state([c.generation for c in choices])
    if state is not None:
        body["tandem"] = {"cache": state}
    return body


def _chat_logprobs(g: Generation) -> list[dict[str, Any]] | None:
    """The content entries since the last chunk (coordinator/logprobs.py), None if not asked."""
    return g.take_logprobs() if g.wants_logprobs else None


class OpenAIRoutes:
    """OpenAI's routes; chat completions is an adapter over Ollama's chat (`start_chat`)."""

    def __init__(self, coordinator: Coordinator, ollama: OllamaRoutes) -> None:
        self.coordinator = coordinator
        self.ollama = ollama
        self.limits = coordinator.config
        # Each served model's file time, as OpenAI's `created`, read once (at start, or when
        # a model loaded on request is first listed).
        self._created = {m.fingerprint: int(m.path.stat().st_mtime) for m in coordinator.models}

    def created(self, model: ServedModel) -> int:
        if model.fingerprint not in self._created:
            self._created[model.fingerprint] = int(model.path.stat().st_mtime)
        return self._created[model.fingerprint]

    async def models(self) -> JSONResponse:
        return JSONResponse(oa.models_list([(m.listed_name, self.created(m))
                                            for m in await self.coordinator.listed_models()]))

    async def one_model(self, name: str) -> JSONResponse:
        model = await self.coordinator.described_model(name)
        return JSONResponse(oa.model_entry(model.listed_name, self.created(model)))

    async def chat_completions(self, request: Request) -> Response:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        req = oa.parse_chat_completion(body, self.limits.max_messages,
                                       await self.ollama.defaults(body))
        model = await self.coordinator.find_model(req.model, timings)
        prompt_ids = await self.ollama.chat_prompt(model, req.model, req.messages, req.tools,
                                                   req.params, timings, think=req.think)
        choices = await submit_choices(self.coordinator, [prompt_ids], req.n, req.params,
                                       timings, request_salt(request, req.cache_salt), model,
                                       turns=[last_user_text(req.messages)])
        rid = oa.new_id("chatcmpl")
        # Tools (coordinator/tool_calls.py): the output is parsed into tool_calls; a forced
        # tool_choice makes the whole output the call. One parser per choice.
        template = model.tokenizer.chat_template

        def parser() -> ToolCallParser | None:
            return (ToolCallParser(call_format(template), req.tools or [], req.tool_choice)
                    if req.tools or req.tool_choice.forced else None)

        def splitter(g: Generation) -> ThinkSplitter | None:
            # reasoning_effort on: the <think> block is reasoning_content (coordinator/thinking.py).
            return ThinkSplitter(started=opens_thinking(model.tokenizer, g)) if req.think else None

        if req.stream:
            streams = [_stream_chat(rid, req.model, c.generation, parser(), c.index,
                                    splitter(c.generation))
                       for c in choices]
            return WatchedStream(_stream_choices(rid, req.model, choices, streams,
                                                 req.include_usage, "chat.completion.chunk"),
                                 lambda: close_all(choices), media_type=SSE)
        texts = await _collect(request, choices)
        if texts is None:
            return Response(status_code=499)
        shaped = []
        for c, content in zip(choices, texts):
            calls, found, thinking, reasoning = parser(), [], splitter(c.generation), None
            if thinking is not None:
                reasoning, content = thinking.split(content)
            if calls is not None:
                content, found = calls.split(content)
            shaped.append(oa.chat_choice(c.index, content, c.generation.done_reason, found,
                                         _chat_logprobs(c.generation), reasoning))
        return JSONResponse(_cache_marked(oa.chat_completion(rid, req.model, shaped,
                                                             _usage(choices)), choices))

    async def completions(self, request: Request) -> Response:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        req = oa.parse_completion(body, await self.ollama.defaults(body))
        model = await self.coordinator.find_model(req.model, timings)
        context = req.params.context_limit(model.context_len)
        prompts = [await off_loop(completion_prompt_ids, model, p, context) for p in req.prompts]
        choices = await submit_choices(self.coordinator, prompts, req.n, req.params, timings,
                                       request_salt(request, req.cache_salt), model,
                                       turns=[p if isinstance(p, str) else None
                                              for p in req.prompts])
        rid = oa.new_id("cmpl")
        echoes = [_Echo(req, req.prompts[c.prompt], prompts[c.prompt], model.tokenizer)
                  if req.echo else None for c in choices]
        if req.stream:
            streams = [_stream_completion(rid, req.model, c.generation, echo, c.index)
                       for c, echo in zip(choices, echoes)]
            return WatchedStream(_stream_choices(rid, req.model, choices, streams,
                                                 req.include_usage, "text_completion",
                                                 score_only=req.score_only),
                                 lambda: close_all(choices), media_type=SSE)
        texts = await _collect(request, choices)
        if texts is None:
            return Response(status_code=499)
        shaped = []
        for c, echo, text in zip(choices, echoes, texts):
            g = c.generation
            if echo is None:
                logprobs = g.take_completion_logprobs(0) if g.wants_logprobs else None
                shaped.append(oa.completion_choice(c.index, text, g.done_reason,
                                                   logprobs=logprobs))
            else:
                text, logprobs = echo.whole(g, text)
                shaped.append(oa.completion_choice(c.index, text, echo.reason(g),
                                                   logprobs=logprobs))
        return JSONResponse(_cache_marked(oa.completion(rid, req.model, shaped,
                                                        _usage(choices, req.score_only)),
                                          choices))


async def _collect(request: Request, choices: list[Choice]) -> list[str] | None:
    """Every choice's whole text, or None if the client left first (all are then cancelled);
    every Generation is closed on return."""
    async def run() -> list[str]:
        texts = [""] * len(choices)
        async for index, piece in merged(choices, [c.generation.pieces() for c in choices]):
            texts[index] += piece
        return texts

    try:
        return await until_disconnected(request, run())
    except ClientGone:
        return None
    finally:
        await close_all(choices)


class _Echo:
    """Completions' echo (openai_api.py): the prompt's text and, when logprobs were asked
    for, its tokens' entries come first; score_only (max_tokens 0) drops the one token
    generated."""

    def __init__(self, req: oa.OpenAIRequest, prompt: str | list[int], prompt_ids: list[int],
                 tokenizer) -> None:
        self.prompt_ids = prompt_ids
        self.text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
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



async def _stream_choices(rid: str, name: str, choices: list[Choice], streams: list,
                          include_usage: bool, obj: str,
                          score_only: bool = False) -> AsyncIterator[bytes]:
    """Every choice's chunks as they come (each carries its index), then the usage summed over
    the choices when asked for, then [DONE]. A worker failing any choice ends the stream with
    an error event (and no [DONE]); the others are cancelled."""
    try:
        async for _, chunk in merged(choices, streams):
            yield chunk
    except WorkerError as exc:
        yield oa.sse(oa.error_body(500, str(exc)))
        return
    if include_usage:
        yield oa.sse(oa.usage_chunk(rid, name, obj, _usage(choices, score_only)))
    yield oa.sse("[DONE]")


async def _stream_chat(rid: str, name: str, g: Generation, calls: ToolCallParser | None,
                       index: int, thinking: ThinkSplitter | None = None) -> AsyncIterator[bytes]:
    """One choice's chunks (WorkerError is raised, for _stream_choices)."""
    made = 0  # tool calls sent so far (their indexes)

    def chunks(content: str, found: list) -> list[bytes]:
        nonlocal made
        out = ([oa.sse(oa.chat_chunk(rid, name, {"content": content},
                                     logprobs=_chat_logprobs(g), index=index))]
               if content else [])
        if found:  # each call whole in one delta, as vLLM's parsers send a finished call
            out.append(oa.sse(oa.chat_chunk(
                rid, name, {"tool_calls": openai_tool_calls(found, first_index=made)},
                index=index)))
            made += len(found)
        return out

    yield oa.sse(oa.chat_chunk(rid, name, {"role": "assistant", "content": ""}, index=index))
    async for thought, content, found in split_thinking(g.pieces(), thinking, calls):
        if thought:  # vLLM's delta for reasoning
            yield oa.sse(oa.chat_chunk(rid, name, {"reasoning_content": thought}, index=index))
        for chunk in chunks(content, found):
            yield chunk
    reason = "tool_calls" if made else g.done_reason
    yield oa.sse(_chunk_marked(oa.chat_chunk(rid, name, {}, reason, done=True,
                                             logprobs=_chat_logprobs(g), index=index), g))


async def _stream_completion(rid: str, name: str, g: Generation, echo: _Echo | None,
                             index: int) -> AsyncIterator[bytes]:
    """One choice's chunks (WorkerError is raised, for _stream_choices)."""
    offset = 0  # characters sent so far: where the next chunk's text_offset starts

    def logprobs() -> dict[str, Any] | None:
        return g.take_completion_logprobs(offset) if g.wants_logprobs else None

    def chunk(text: str, reason: str | None = None, done: bool = False,
              logprobs_: dict[str, Any] | None = None) -> bytes:
        body = oa.completion(rid, name, [oa.completion_choice(
            index, text, reason, done=done, logprobs=logprobs_)], None, chunk=True)
        return oa.sse(_chunk_marked(body, g) if done else body)

    def echoed() -> bytes:
        # The prompt's chunk: its logprobs come with the first token, so it goes out once
        # that arrived (before the first piece, or at the end).
        nonlocal offset, echo
        out = chunk(echo.text, logprobs_=echo.prompt_logprobs(g))
        offset, echo = len(echo.text), None
        return out

    score_only = echo is not None and echo.score_only
    async for piece in g.pieces():
        if echo is not None and not score_only:
            yield echoed()
        if score_only:
            continue
        yield chunk(piece, logprobs_=logprobs())
        offset += len(piece)
    if echo is not None:
        yield echoed()
    reason = "length" if score_only else g.done_reason
    yield chunk("", reason, done=True, logprobs_=None if score_only else logprobs())
