"""The HTTP front door (FastAPI): Ollama's API here, OpenAI's in openai_routes.py.

Routes stay thin: parse (ollama_request) -> tokenize (prompts) -> check and admit
(Coordinator) -> shape (ollama_response). Errors before any output are a status with
{"error": ...} (OpenAI's nested shape under /v1/); errors after the stream started are a last
NDJSON line {"error": ...}. A client that disconnects has its request cancelled on every worker
(http_stream.py). Unknown routes and wrong methods answer in the same shapes (http_errors.py);
the API key and browser origins are checked before any route runs (access.py).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from coordinator import model_info
from coordinator.access import install_http_access
from coordinator.admission import Overloaded, TooManyStreams
from coordinator.generation import Generation
from coordinator.http_errors import error_response
from coordinator.http_stream import ClientGone, WatchedStream, read_json_body, until_disconnected
from coordinator.metrics import RequestTimings
from coordinator.ollama_request import RequestError, parse_chat, parse_generate, parse_show
from coordinator.ollama_response import (
    chat_chunk, chat_final, chat_load, error_body, generate_chunk, generate_final, generate_load,
    ndjson,
)
from coordinator.embedding_routes import add_embedding_routes
from coordinator.model_routes import add_model_routes
from coordinator.openai_routes import add_openai_routes
from coordinator.openapi import install_openapi
from coordinator.tool_calls import (
    ToolCallParser, call_format, ollama_tool_calls, require_tool_support,
)
from coordinator.model import shown
from coordinator.prompts import chat_prompt_ids, generate_prompt_ids, off_loop
from coordinator.request_flow import NoWorkers, WorkerError
from coordinator.service import Coordinator
from common.errors import ModelNotFoundError, TandemError

log = logging.getLogger(__name__)


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


def _error(request: Request, status: int, message: str,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return error_response(request.url.path, status, message, headers)


def _add_error_handlers(app: FastAPI, coordinator: Coordinator) -> None:
    retry = {"Retry-After": str(coordinator.config.retry_after_s)}

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own: an unknown route (404), a wrong method (405, with its Allow header).
        if exc.status_code == 404:
            message = f"{request.method} {shown(request.url.path)}: no such route"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = (f"method {request.method} is not allowed on {shown(request.url.path)}"
                       + (f" (allowed: {allowed})" if allowed else ""))
        else:
            message = str(exc.detail)
        return _error(request, exc.status_code, message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                             for e in exc.errors())
        return _error(request, 400, f"invalid request: {problems}")

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _error(request, exc.status, str(exc))

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        status = 429 if isinstance(exc, TooManyStreams) else 503
        return _error(request, status, str(exc), {"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(NoWorkers)
    async def _no_workers(request: Request, exc: NoWorkers) -> JSONResponse:
        return _error(request, 503, str(exc), retry)

    @app.exception_handler(ModelNotFoundError)
    async def _not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return _error(request, 404, str(exc))

    @app.exception_handler(TandemError)
    async def _user_error(request: Request, exc: TandemError) -> JSONResponse:
        return _error(request, 400, str(exc))

    @app.exception_handler(WorkerError)
    async def _worker_error(request: Request, exc: WorkerError) -> JSONResponse:
        return _error(request, 500, str(exc))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while sending its body: nobody reads an answer, nothing failed here.
        # A handler for this class (not Exception's) keeps Starlette from re-raising it, so
        # uvicorn does not log a traceback either.
        log.info("client %s left before sending the whole body of %s %s",
                 request.client.host if request.client else "?", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(request, 500, f"internal error: {type(exc).__name__}: {exc}")


def _internal_client(request: Request, networks: list) -> bool:
    """True for a loopback peer, a peer on this host, or one in `networks`.

    A peer whose address is the address it connected to is on this host: Linux routes a
    connection to one of its own addresses over loopback with that address as the source, and
    drops packets from outside that claim a local source address (a spoofed SYN could not
    complete the handshake anyway)."""
    if request.client is None:
        return False
    try:
        peer = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    if peer.is_loopback:
        return True
    server = request.scope.get("server")
    if server and server[0] == request.client.host:
        return True
    return any(peer in network for network in networks)


def check_model(coordinator: Coordinator, name: str) -> None:
    if not coordinator.model.answers_to(name):
        raise ModelNotFoundError(f"model '{shown(name)}' not found")


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


def create_app(coordinator: Coordinator, lifespan: Any = None) -> FastAPI:
    # /openapi.json describes every route and its real request body (coordinator/openapi.py);
    # no /docs page: the coordinator serves no HTML or scripts.
    app = FastAPI(title="tandem", version=tandem_version(), lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    model = coordinator.model
    info = model_info.describe(model)
    limits = coordinator.config
    _add_error_handlers(app, coordinator)
    install_http_access(app, limits.api_key, limits.allowed_origins, tandem_version())

    @app.get("/")
    @app.head("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("Ollama is running")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(coordinator.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # Worker addresses, KV endpoints and the model fingerprint a worker registers with: for the
    # launchers on this host (deploy/local.py, deploy/launch.py, deploy/ray_launcher.py and the
    # tests poll it), and for networks named by --internal-api-from; a 403 to everyone else.
    internal_from = [ipaddress.ip_network(n, strict=False) for n in limits.internal_api_from]

    @app.get("/internal/workers")
    async def workers(request: Request) -> JSONResponse:
        if not _internal_client(request, internal_from):
            return _error(request, 403, "/internal/workers is served only to clients on the "
                                        "coordinator's host (or in --internal-api-from)")
        return JSONResponse(coordinator.workers_report())

    @app.api_route("/api/version", methods=["GET", "HEAD"])  # HEAD too, as Ollama
    async def api_version() -> JSONResponse:
        return JSONResponse({"version": OLLAMA_API_VERSION, "tandem": tandem_version()})

    @app.api_route("/api/tags", methods=["GET", "HEAD"])  # HEAD too, as Ollama
    async def tags() -> JSONResponse:
        return JSONResponse({"models": [model_info.tags_entry(info)]})

    @app.get("/api/ps")
    async def ps() -> JSONResponse:
        # Loaded while a worker that serves it is alive and keep_alive has not unloaded it.
        residency = coordinator.residency
        loaded = residency.resident and any(coordinator.registry.live_counts().values())
        entry = model_info.ps_entry(info, residency.expires_at_iso())
        return JSONResponse({"models": [entry] if loaded else []})

    @app.post("/api/show")
    async def show(request: Request) -> JSONResponse:
        check_model(coordinator, parse_show(await read_json_body(request, limits.max_body_bytes)))
        return JSONResponse(model_info.show_body(model, info))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        timings = RequestTimings()
        req = parse_chat(await read_json_body(request, limits.max_body_bytes),
                         limits.max_messages)
        check_model(coordinator, req.model)
        if not req.messages:
            await coordinator.preload(req.keep_alive)
            return JSONResponse(chat_load(model.name, req.unload))
        template = model.tokenizer.chat_template
        require_tool_support(req.tools, template, req.model)  # 400 as Ollama's
        prompt_ids = await off_loop(chat_prompt_ids, model, req.messages, req.tools,
                                    req.params.context_limit(model.context_len))
        generation = await coordinator.submit(prompt_ids, req.params, timings, req.keep_alive)
        # With tools, the output is parsed into message.tool_calls (coordinator/tool_calls.py).
        calls = ToolCallParser(call_format(template), req.tools) if req.tools else None
        if req.stream:
            return WatchedStream(_stream_chat(model.name, generation, calls), generation.close)
        content = await collect(request, generation)
        if content is None:
            return Response(status_code=499)
        found = []
        if calls is not None:
            content, found = calls.split(content)
        return JSONResponse(chat_final(model.name, generation, content, ollama_tool_calls(found)))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        timings = RequestTimings()
        req = parse_generate(await read_json_body(request, limits.max_body_bytes))
        check_model(coordinator, req.model)
        if not req.prompt and not req.context:
            await coordinator.preload(req.keep_alive)
            return JSONResponse(generate_load(model.name, req.unload))
        prompt_ids = await off_loop(generate_prompt_ids, model, req.prompt, req.system, req.raw,
                                    req.context, req.params.context_limit(model.context_len))
        generation = await coordinator.submit(prompt_ids, req.params, timings, req.keep_alive)

        def context() -> list[int] | None:
            return None if req.raw else prompt_ids + generation.output_ids

        if req.stream:
            return WatchedStream(_stream_generate(model.name, generation, context),
                                 generation.close)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        return JSONResponse(generate_final(model.name, generation, text, context()))

    add_openai_routes(app, coordinator, collect, check_model)
    add_model_routes(app, coordinator)
    add_embedding_routes(app, coordinator)
    install_openapi(app)
    return app


async def _stream_chat(name: str, generation: Generation,
                       calls: ToolCallParser | None = None) -> AsyncIterator[bytes]:
    made = 0  # tool calls sent so far (their indexes)

    def lines(content: str, found: list) -> list[bytes]:
        nonlocal made
        out = [ndjson(chat_chunk(name, content, g=generation))] if content else []
        if found:  # Ollama sends calls in a chunk of their own, before the final one
            out.append(ndjson(chat_chunk(name, "", ollama_tool_calls(found, made))))
            made += len(found)
        return out

    try:
        async for piece in generation.pieces():
            if calls is None:
                yield ndjson(chat_chunk(name, piece, g=generation))
                continue
            for line in lines(*calls.push(piece)):
                yield line
        if calls is not None:
            for line in lines(*calls.finish()):
                yield line
    except WorkerError as exc:
        yield ndjson(error_body(str(exc)))
        return
    yield ndjson(chat_final(name, generation))


async def _stream_generate(name: str, generation: Generation, context) -> AsyncIterator[bytes]:
    try:
        async for piece in generation.pieces():
            yield ndjson(generate_chunk(name, piece, generation))
    except WorkerError as exc:
        yield ndjson(error_body(str(exc)))
        return
    yield ndjson(generate_final(name, generation, context=context()))
