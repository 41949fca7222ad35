"""The HTTP front door (FastAPI): the app, its error handlers and access checks, with every
route of coordinator/routes.py's table (Ollama's API, OpenAI's under /v1/, model management,
embeddings, /metrics, /internal/workers).

Errors before any output are a status with {"error": ...} (OpenAI's nested shape under /v1/);
errors after a stream started are its last line (the handlers'). Unknown routes and wrong
methods answer in the same shapes (http_errors.py); the Host, the API key and browser origins
are checked before any route runs (access.py).
"""

from __future__ import annotations

import logging
from itertools import groupby
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from coordinator.access import install_http_access
from coordinator.access_log import install_request_log
from coordinator.admission import Overloaded, TooManyStreams
from coordinator.http_stream import ClientGone
from coordinator.http_errors import error_response
from coordinator.model import shown
from coordinator.ollama_request import RequestError
from coordinator.ollama_routes import tandem_version
from coordinator.openapi import install_openapi
from coordinator.request_flow import NoWorkers, WorkerError
from coordinator.response_cache_header import install_cache_header
from coordinator.routes import generate_routes
from coordinator.service import Coordinator
from common.errors import ModelNotFoundError, TandemError

log = logging.getLogger(__name__)


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
        # OpenAI's code for a model it does not serve (its clients read it); /v1/ only.
        return error_response(request.url.path, 404, str(exc), code="model_not_found")

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

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        # The client left while its non-streamed answer was computed; the work was cancelled.
        log.info("client %s left before the answer to %s %s; its work was cancelled",
                 request.client.host if request.client else "?", request.method,
                 request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return _error(request, 500, f"internal error: {type(exc).__name__}: {exc}")


DOCS_ASSETS = "/docs/assets"  # Swagger UI's script, style and icon


def create_app(coordinator: Coordinator, lifespan: Any = None) -> FastAPI:
    # /openapi.json describes every route and its real request body (coordinator/openapi.py);
    # /docs is Swagger UI over it, its script and style served from DOCS_ASSETS out of the
    # fastapi-offline package (no CDN: the page works on a host with no way out). All of them
    # sit behind the API key when one is set.
    app = FastAPIOffline(title="tandem", version=tandem_version(), lifespan=lifespan,
                         docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                         static_url=DOCS_ASSETS)
    limits = coordinator.config
    _add_error_handlers(app, coordinator)
    if coordinator.response_cache is not None:
        install_cache_header(app)  # X-Tandem-Cache (coordinator/response_cache_header.py)
    install_http_access(app, limits.api_keys(), (limits.host, *limits.allowed_hosts),
                        limits.allowed_origins, tandem_version())
    install_request_log(app, limits.access_log)  # outermost: every answer gets an id
    # Rows of one path and handler (GET and HEAD) are one route, so a 405 names every method.
    for (path, handler), rows in groupby(generate_routes(coordinator),
                                         key=lambda r: (r.path, r.handler)):
        app.add_api_route(path, handler, methods=[r.method for r in rows])
    install_openapi(app)
    return app
