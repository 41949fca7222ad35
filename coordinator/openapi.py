"""/openapi.json: the coordinator's HTTP API as OpenAPI 3.1, with the real request bodies.

The routes take a raw Request and parse it by hand (see request_schemas.py for why), so
FastAPI's generated document knows their paths and nothing of their bodies. This fills in,
per route: the request body (request_schemas.REQUEST_BODIES), the content types a success
answers with (JSON, NDJSON or SSE streams, plain text), and the error shape of the API the path
belongs to (Ollama's {"error": "..."}; OpenAI's {"error": {"message", "type", "param",
"code"}} under /v1/), for the statuses the routes answer with. A 503 (no live worker, or
overloaded, with Retry-After) is documented: it is the server saying "later", not a fault. A
500 is not documented: it is always a bug or a worker's failure.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from coordinator.http_errors import is_openai_path
from coordinator.request_schemas import REQUEST_BODIES

_OLLAMA_ERROR = {"type": "object", "required": ["error"],
                 "properties": {"error": {"type": "string"}}}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}

# Statuses a request can be answered with before any output, and why.
_ERRORS = {
    "400": "the body or a field is invalid (the message names it)",
    "401": "a wrong or missing API key (--api-key)",
    "403": "a browser origin or client that is not allowed",
    "404": "no such model or route",
    "405": "a method the route does not take",
    "409": "the model is being served, so it cannot be deleted or replaced",
    "413": "the body is larger than --max-body-bytes (a blob: --max-blob-bytes)",
    "429": "too many open streams; Retry-After says when to retry",
    "501": "this coordinator was started without a model store",
    "503": "no live worker, or the queue is full; Retry-After says when to retry",
    "507": "the model store's disk has no room for the blob",
}
# Successes other than 200, by path.
_CREATED = {"/api/blobs/{digest}": "the blob's bytes hash to its digest and are kept"}

_NDJSON = "application/x-ndjson"
_SSE = "text/event-stream"
# path -> the content types of a success, when not JSON alone; [] = an empty body
_SUCCESS: dict[str, list[str]] = {
    "/": ["text/plain"], "/metrics": ["text/plain"], "/ui": ["text/html"],
    "/api/chat": ["application/json", _NDJSON], "/api/generate": ["application/json", _NDJSON],
    "/api/pull": ["application/json", _NDJSON], "/api/create": ["application/json", _NDJSON],
    "/api/copy": [], "/api/delete": [], "/api/blobs/{digest}": [],
    "/v1/chat/completions": ["application/json", _SSE],
    "/v1/completions": ["application/json", _SSE],
    "/v1/responses": ["application/json", _SSE],
}


def _responses(path: str) -> dict[str, Any]:
    error = {"$ref": "#/components/schemas/"
                     + ("OpenAIError" if is_openai_path(path) else "OllamaError")}
    success: dict[str, Any] = {"description": "success"}
    types = _SUCCESS.get(path, ["application/json"])
    if types:
        success["content"] = {t: {"schema": {}} for t in types}
    out = {"200": success}
    if path in _CREATED:
        out["201"] = {"description": _CREATED[path]}
    out.update({status: {"description": why, "content": {"application/json": {"schema": error}}}
                for status, why in _ERRORS.items()})
    return out


def openapi_document(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():
        # GET and HEAD of one api_route share an operationId; made unique below.
        warnings.filterwarnings("ignore", message="Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description=__doc__.split("\n\n")[0])
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(OllamaError=_OLLAMA_ERROR, OpenAIError=_OPENAI_ERROR)
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            if method == "head":
                operation["operationId"] = operation.get("operationId", path) + "_head_only"
            operation["responses"] = _responses(path)
            model = REQUEST_BODIES.get((method, path))
            if model is None:
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve openapi_document at the app's openapi_url (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
