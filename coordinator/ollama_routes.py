"""Ollama's API handlers: /, /api/version, /api/tags, /api/ps, /api/show, /api/chat,
/api/generate (the table is coordinator/routes.py).

Handlers stay thin: parse (ollama_request) -> tokenize (prompts) -> check and admit
(Coordinator) -> shape (ollama_response). Errors before any output are raised and answered as
a status with {"error": ...} (http_api.py's exception handlers); errors after the stream
started are a last NDJSON line {"error": ...}. A client that disconnects has its request
cancelled on every worker (http_stream.py). OpenAI's chat completions reuses `start_chat`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from coordinator import model_info
from coordinator.access import request_salt
from coordinator.generation import Generation
from coordinator.http_stream import WatchedStream, collect, read_json_body
from coordinator.metrics import RequestTimings
from coordinator.model import ServedModel
from coordinator.ollama_request import (
    NO_DEFAULTS, model_named, parse_chat, parse_generate, parse_show,
)
from coordinator.ollama_response import (
    chat_chunk, chat_final, chat_load, error_body, generate_chunk, generate_final, generate_load,
    ndjson,
)
from coordinator.prompts import chat_prompt_ids, fit_chat, generate_prompt_ids, off_loop
from coordinator.request_flow import WorkerError
from coordinator.response_cache import last_user_text
from coordinator.service import Coordinator
from coordinator.thinking import ThinkSplitter, opens_thinking, split_thinking, template_args
from coordinator.tool_calls import (
    ToolCallParser, call_format, ollama_tool_calls, require_tool_support,
)
from common.model_defaults import ModelDefaults
from common.sampling_params import SamplingParams


def tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "0.0.0"


# The Ollama release whose API tandem's routes match, for /api/version: clients compare it
# with the release that brought a feature before they use it, and tandem's own 0.1.0 would
# read as an Ollama from 2023.
# 0.12.10: /api/chat, /api/generate, /api/show (capabilities, model_info, template,
# parameters), /api/tags and /api/ps answer with that release's fields; `think` and `images`
# are refused as that release refuses them for a model without the capability; `logprobs`
# arrived in 0.12.11, and tandem refuses it, so a client that gates it on the version will not
# send it. tandem's own version: the X-Tandem-Version header and /api/version's "tandem".
OLLAMA_API_VERSION = "0.12.10"


class OllamaRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        # Each served model's description, computed once (copies add names, not weights);
        # a model loaded on request gets its own when first listed.
        self._infos = {m.fingerprint: model_info.describe(m) for m in coordinator.models}
        self.limits = coordinator.config

    def info(self, model: ServedModel) -> dict:
        if model.fingerprint not in self._infos:
            self._infos[model.fingerprint] = model_info.describe(model)
        return self._infos[model.fingerprint]

    async def _model(self, name: str, timings: RequestTimings | None = None) -> ServedModel:
        """The model a request names, as it stands now (loaded first when the stores hold it
        and models load on request, the wait in `timings`); a 404 for any other."""
        return await self.coordinator.find_model(name, timings)

    async def defaults(self, body: object) -> ModelDefaults:
        """The default options and system prompt of the model a body names (none for a name
        no model answers to: the 404 comes after the body's own checks, as before). A model
        the stores hold that is not loaded is read for them, not loaded."""
        name = model_named(body)
        model = self.coordinator.models.find(name) if name else None
        if model is None and name and self.coordinator.on_demand is not None:
            model = await self.coordinator.on_demand.describe(name)
        return model.defaults if model is not None else NO_DEFAULTS

    async def root(self) -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    async def api_version(self) -> JSONResponse:
        return JSONResponse({"version": OLLAMA_API_VERSION, "tandem": tandem_version()})

    async def tags(self) -> JSONResponse:
        return JSONResponse({"models": [model_info.tags_entry(self.info(m))
                                        for m in await self.coordinator.listed_models()]})

    async def ps(self) -> JSONResponse:
        # A model is loaded while a worker of it is alive and keep_alive has not unloaded it.
        entries = []
        for model in self.coordinator.models:
            pool = self.coordinator.pool(model)
            if pool.residency.resident and any(pool.workers.live_counts().values()):
                entries.append(model_info.ps_entry(self.info(model),
                                                   pool.residency.expires_at_iso()))
        return JSONResponse({"models": entries})

    async def show(self, request: Request) -> JSONResponse:
        name = parse_show(await read_json_body(request, self.limits.max_body_bytes))
        model = await self.coordinator.described_model(name)
        return JSONResponse(model_info.show_body(model, self.info(model)))

    async def _unload(self, name: str) -> str:
        """keep_alive 0 without a prompt: the model unloaded (a served one once its requests
        end; one loaded on request: its workers stopped); a model the stores hold that is not
        loaded stays so. The name the answer carries; a 404 for a name nothing holds."""
        model = self.coordinator.models.find(name)
        if model is not None:
            await self.coordinator.preload(0, model)
            return model.name
        described = (await self.coordinator.on_demand.describe(name)
                     if self.coordinator.on_demand is not None else None)
        if described is None:
            self.coordinator.models.get(name)  # the 404, as for any name not served
        return described.name

    async def start_chat(self, name: str, messages: list[dict], tools: list[dict] | None,
                         params: SamplingParams, timings: RequestTimings,
                         keep_alive: float | None = None, cache_salt: bytes = b"",
                         truncate: bool = False, think: bool | str | None = None) -> Generation:
        """A chat admitted: the model checked, tools checked against the template (a 400 as
        Ollama's), the messages rendered and tokenized off the loop. /v1/chat/completions too.
        truncate: drop the oldest messages of a chat longer than its context (Ollama's
        /api/chat default) instead of refusing it. think: Ollama's (coordinator/thinking.py)."""
        model = await self._model(name, timings)
        prompt_ids = await self.chat_prompt(model, name, messages, tools, params, timings,
                                            truncate, think)
        return await self.coordinator.submit(prompt_ids, params, timings, keep_alive, cache_salt,
                                             model, turn=last_user_text(messages))

    async def chat_prompt(self, model: ServedModel, name: str, messages: list[dict],
                          tools: list[dict] | None, params: SamplingParams,
                          timings: RequestTimings, truncate: bool = False,
                          think: bool | str | None = None) -> list[int]:
        """start_chat's checks and rendering of `model` (as the request `name`d it), without
        the submit (several choices of one prompt: coordinator/choices.py). The model's
        default system prompt opens a chat that has none (common/model_defaults.py)."""
        messages = model.defaults.with_system(messages)
        require_tool_support(tools, model.tokenizer.chat_template, name)
        args = template_args(think, model.tokenizer.chat_template, name)
        context = params.context_limit(model.context_len)
        if truncate:
            fitted = await off_loop(fit_chat, model, messages, tools, context, args)
            prompt_ids = fitted.prompt_ids
            timings.truncated_messages = fitted.dropped_messages
            timings.truncated_tokens = fitted.dropped_tokens
        else:
            prompt_ids = await off_loop(chat_prompt_ids, model, messages, tools, context, args)
        return prompt_ids

    async def chat(self, request: Request) -> Response:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        req = parse_chat(body, self.limits.max_messages, await self.defaults(body))
        if not req.messages and req.keep_alive == 0:  # unload: never load it for that
            return JSONResponse(chat_load(await self._unload(req.model), req.unload))
        model = await self._model(req.model, timings)
        name = model.name
        if not req.messages:
            await self.coordinator.preload(req.keep_alive, model)
            return JSONResponse(chat_load(name, req.unload))
        generation = await self.start_chat(req.model, req.messages, req.tools, req.params,
                                           timings, req.keep_alive, request_salt(request),
                                           truncate=req.truncate, think=req.think)
        # With tools, the output is parsed into message.tool_calls (coordinator/tool_calls.py).
        template = model.tokenizer.chat_template
        calls = ToolCallParser(call_format(template), req.tools) if req.tools else None
        # With think, the <think> block is message.thinking (coordinator/thinking.py).
        thinking = (ThinkSplitter(started=opens_thinking(model.tokenizer, generation))
                    if req.think else None)
        if req.stream:
            return WatchedStream(_stream_chat(name, generation, calls, thinking),
                                 generation.close)
        content = await collect(request, generation)
        if content is None:
            return Response(status_code=499)
        thought, content = thinking.split(content) if thinking is not None else ("", content)
        found = []
        if calls is not None:
            content, found = calls.split(content)
        return JSONResponse(chat_final(name, generation, content, ollama_tool_calls(found),
                                       thought))

    async def generate(self, request: Request) -> Response:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        req = parse_generate(body, await self.defaults(body))
        if not req.prompt and not req.context and req.keep_alive == 0:
            return JSONResponse(generate_load(await self._unload(req.model), req.unload))
        model = await self._model(req.model, timings)
        if not req.prompt and not req.context:
            await self.coordinator.preload(req.keep_alive, model)
            return JSONResponse(generate_load(model.name, req.unload))
        # think (coordinator/thinking.py): as on /api/chat; the <think> block is `thinking`.
        args = template_args(req.think, model.tokenizer.chat_template, req.model)
        prompt_ids = await off_loop(generate_prompt_ids, model, req.prompt, req.system, req.raw,
                                    req.context, req.params.context_limit(model.context_len),
                                    args)
        generation = await self.coordinator.submit(prompt_ids, req.params, timings,
                                                   req.keep_alive, request_salt(request), model,
                                                   turn=req.prompt or None)
        thinking = (ThinkSplitter(started=opens_thinking(model.tokenizer, generation))
                    if req.think else None)

        def context() -> list[int] | None:
            return None if req.raw else prompt_ids + generation.output_ids

        if req.stream:
            return WatchedStream(_stream_generate(model.name, generation, context, thinking),
                                 generation.close)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        thought, text = thinking.split(text) if thinking is not None else ("", text)
        return JSONResponse(generate_final(model.name, generation, text, context(), thought))


async def _stream_chat(name: str, generation: Generation, calls: ToolCallParser | None = None,
                       thinking: ThinkSplitter | None = None) -> AsyncIterator[bytes]:
    made = 0  # tool calls sent so far (their indexes)

    def lines(content: str, found: list) -> list[bytes]:
        nonlocal made
        out = [ndjson(chat_chunk(name, content, g=generation))] if content else []
        if found:  # Ollama sends calls in a chunk of their own, before the final one
            out.append(ndjson(chat_chunk(name, "", ollama_tool_calls(found, made))))
            made += len(found)
        return out

    try:
        async for thought, content, found in split_thinking(generation.pieces(), thinking, calls):
            if thought:
                yield ndjson(chat_chunk(name, "", g=generation, thinking=thought))
            for line in lines(content, found):
                yield line
    except WorkerError as exc:
        yield ndjson(error_body(str(exc)))
        return
    yield ndjson(chat_final(name, generation))


async def _stream_generate(name: str, generation: Generation, context,
                           thinking: ThinkSplitter | None = None) -> AsyncIterator[bytes]:
    try:
        async for thought, piece, _ in split_thinking(generation.pieces(), thinking, None):
            if thought or piece or thinking is None:  # no chunk for a tag held back
                yield ndjson(generate_chunk(name, piece, generation, thought))
    except WorkerError as exc:
        yield ndjson(error_body(str(exc)))
        return
    yield ndjson(generate_final(name, generation, context=context()))
