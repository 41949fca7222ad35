"""Every HTTP error of the coordinator, in the shape of the API its path belongs to: OpenAI's
nested `{"error": {"message", "type", "param", "code"}}` under /v1/, Ollama's `{"error": "..."}`
everywhere else. Used by the app's exception handlers (http_api.py, Starlette's own errors too:
unknown routes, wrong methods), /internal/workers (ops_routes.py) and the access middleware
(access.py)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from coordinator.model import shown
from coordinator.ollama_response import error_body as ollama_error
from coordinator.openai_api import error_body as openai_error

MAX_ERROR_CHARS = 1000  # an error message never echoes more of what the client sent


def is_openai_path(path: str) -> bool:
    # vLLM's /tokenize, /detokenize and /tokenizer_info answer errors as its OpenAI routes do.
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize",
                                                                "/tokenizer_info")


def error_response(path: str, status: int, message: str, headers: dict[str, str] | None = None,
                   code: str | None = None) -> JSONResponse:
    """`code`: OpenAI's machine-readable error code (e.g. "invalid_api_key"), /v1/ only."""
    message = shown(message, MAX_ERROR_CHARS)
    body = openai_error(status, message, code) if is_openai_path(path) else ollama_error(message)
    return JSONResponse(body, status_code=status, headers=headers)
