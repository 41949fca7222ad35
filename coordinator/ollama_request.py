"""Parsing and validating Ollama API request bodies into typed requests.

Every problem is a RequestError with the HTTP status Ollama uses (400 for a missing body,
invalid JSON or a bad field; 404 for an unknown model is decided by the caller, which knows
the served model). Unknown top-level fields are ignored, as Ollama's Go decoder does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from engine.errors import TandemError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")


class RequestError(TandemError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict]  # validated: role and string content
    stream: bool
    params: SamplingParams
    tools: list[dict] | None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise RequestError("missing request body")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    return model


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:
        return True  # Ollama streams unless told otherwise
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {json.dumps(stream)}")
    return stream


def _message(index: int, message: Any) -> dict:
    if not isinstance(message, dict):
        raise RequestError(f"messages[{index}] must be an object")
    role = message.get("role")
    if role not in _ROLES:
        raise RequestError(f"messages[{index}].role must be one of {', '.join(_ROLES)}, "
                           f"got {json.dumps(role)}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{index}].content must be a string")
    if message.get("images"):
        raise RequestError("images are not supported: the served model has no vision input")
    return {k: v for k, v in message.items() if k != "images"}


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    model = _model(body)
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list):
        raise RequestError("messages must be a list")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects")
    if body.get("format") not in (None, ""):
        raise RequestError("format (structured output) is not supported yet")
    params = SamplingParams.from_options(body.get("options"), warn=log.warning)
    return ChatRequest(model=model, messages=[_message(i, m) for i, m in enumerate(messages)],
                       stream=_stream(body), params=params, tools=tools or None)
