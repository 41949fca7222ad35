"""Parsing and validating Ollama API request bodies into typed requests.

Every problem is a RequestError with the HTTP status Ollama uses (400 for a missing body,
invalid JSON or a bad field; 404 for an unknown model is decided by the caller, which knows
the served model). Unknown top-level fields are ignored, as Ollama's Go decoder does. The
options are laid over the named model's default options (common/model_defaults.py), which the
caller looks up by the body's `model` before parsing (so a bad field is still a 400 first).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from typing import Any

from coordinator.residency import KeepAliveError, parse_keep_alive
from coordinator.structured_output import ollama_format
from coordinator.tool_calls import check_tool_list
from common.errors import TandemError
from common.model_defaults import ModelDefaults
from common.logprobs import MAX_LOGPROBS
from common.sampling_params import SamplingParams

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
    unload: bool = False  # keep_alive 0: with no messages, Ollama answers done_reason "unload"
    keep_alive: float | None = None  # seconds the model stays loaded after (None = default)
    # Ollama's `truncate` (default true): a conversation longer than the context drops its
    # oldest non-system messages until it fits (coordinator/prompts.py fit_chat); false: a 400.
    truncate: bool = True
    # Ollama's `think` (coordinator/thinking.py): None, a bool, or "low" | "medium" | "high".
    think: bool | str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    model: str
    prompt: str
    system: str | None  # replaces the template's default system message
    raw: bool  # the prompt is sent as is, without the chat template
    context: list[int]  # token ids of an earlier exchange (deprecated by Ollama, still sent)
    stream: bool
    params: SamplingParams
    unload: bool = False
    keep_alive: float | None = None  # as in ChatRequest
    think: bool | str | None = None  # as in ChatRequest: the thinking is the answer's `thinking`


MAX_JSON_DEPTH = 64  # nesting of objects and arrays in a request body (tools schemas included)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise RequestError("missing request body")
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the interpreter's stack: far past MAX_JSON_DEPTH
        raise RequestError(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer of over 4,300 digits
        raise RequestError(f"invalid JSON in request body: {_clip(str(exc))}") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    check_json_tree(body)
    return body


def check_json_tree(body: dict[str, Any]) -> None:
    """Refuse what json.loads accepts but nothing downstream should see: nesting past
    MAX_JSON_DEPTH (walked without recursion) and strings that are not valid Unicode (JSON's
    "\\ud800" escape decodes to a lone surrogate, which no tokenizer or encoder accepts)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for text in (key, item):
                bad = _SURROGATE.search(text) if isinstance(text, str) else None
                if bad is not None:
                    raise RequestError("request body holds invalid Unicode: a lone surrogate "
                                       f"(U+{ord(bad.group()):04X}) in a string")
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: valid JSON, not Unicode


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    return model


def stream_flag(body: dict[str, Any]) -> bool:
    """Ollama's `stream` field: true unless the body says false."""
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
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list)
                                  and all(isinstance(c, dict) for c in calls)):
        raise RequestError(f"messages[{index}].tool_calls must be a list of objects")
    # A null or missing content is empty, as in Ollama (Go decodes null into ""); templates
    # read message.content and would fail on its absence.
    return {**{k: v for k, v in message.items() if k != "images"}, "content": content or ""}


def check_messages(messages: Any, max_messages: int) -> list[dict]:
    """Validated messages (shared with the OpenAI surface)."""
    if not isinstance(messages, list):
        raise RequestError("messages must be a list")
    if len(messages) > max_messages:
        raise RequestError(f"too many messages: {len(messages)} (limit {max_messages})")
    return [_message(i, m) for i, m in enumerate(messages)]


def _unsupported(body: dict[str, Any], model: str) -> None:
    """Request features the served models cannot honour: refused, never silently dropped.
    (`think` is the template's to honour: coordinator/thinking.py.)"""
    if body.get("images"):
        raise RequestError("images are not supported: the served model has no vision input")


def _with_format(params: SamplingParams, body: dict[str, Any]) -> SamplingParams:
    """`format` ("json" or a JSON schema) -> the grammar the sampler enforces; `logprobs`
    (true/false) and `top_logprobs` (0..20) -> SamplingParams.logprobs. As in Ollama,
    top_logprobs without logprobs asks for nothing."""
    grammar = ollama_format(body.get("format"))
    params = params if grammar is None else replace(params, grammar=grammar)
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false, got {json.dumps(wanted)[:60]}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, "
                           f"got {json.dumps(top)[:60]}")
    return replace(params, logprobs=top or 0) if wanted else params


def _keep_alive(body: dict[str, Any]) -> float | None:
    """keep_alive in seconds (coordinator/residency.py); None when not given."""
    try:
        return parse_keep_alive(body.get("keep_alive"))
    except KeepAliveError as exc:
        raise RequestError(str(exc)) from None


NO_DEFAULTS = ModelDefaults()


def _params(body: dict[str, Any], defaults: ModelDefaults) -> SamplingParams:
    options = defaults.options_under(body.get("options"))
    return _with_format(SamplingParams.from_options(options, warn=log.warning), body)


def parse_chat(body: dict[str, Any], max_messages: int,
               defaults: ModelDefaults = NO_DEFAULTS) -> ChatRequest:
    model = _model(body)
    messages = check_messages(body.get("messages") or [], max_messages)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects")
    check_tool_list(tools)
    _unsupported(body, model)
    params = _params(body, defaults)
    keep_alive = _keep_alive(body)
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise RequestError(f"truncate must be true or false, got {json.dumps(truncate)[:60]}")
    return ChatRequest(model=model, messages=messages,
                       stream=stream_flag(body), params=params, tools=tools or None,
                       unload=keep_alive == 0, keep_alive=keep_alive, truncate=truncate,
                       think=_think(body))


def _think(body: dict[str, Any]) -> bool | str | None:
    think = body.get("think")
    if not (think is None or isinstance(think, bool) or think in ("low", "medium", "high")):
        raise RequestError(f"think must be true, false or one of low, medium, high, got "
                           f"{json.dumps(think)[:60]}")
    return think


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {json.dumps(value)[:60]}")
    return value or None


def parse_generate(body: dict[str, Any], defaults: ModelDefaults = NO_DEFAULTS) -> GenerateRequest:
    """The request's `system`, else the model's default system prompt (`defaults`), unless
    raw: Ollama's GenerateHandler."""
    model = _model(body)
    prompt = _optional_str(body, "prompt") or ""
    system = _optional_str(body, "system")
    _unsupported(body, model)
    think = _think(body)
    if _optional_str(body, "suffix"):
        raise RequestError(f'"{model}" does not support insert')
    if _optional_str(body, "template"):
        raise RequestError("template overrides are not supported: tandem renders the model's "
                           "own chat template (send raw: true with a preformatted prompt)")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise RequestError(f"raw must be true or false, got {json.dumps(raw)}")
    context = body.get("context") or []
    if not (isinstance(context, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in context)):
        raise RequestError("context must be a list of token ids")
    params = _params(body, defaults)
    keep_alive = _keep_alive(body)
    return GenerateRequest(model=model, prompt=prompt, system=system or defaults.system, raw=raw, context=context,
                           stream=stream_flag(body), params=params, unload=keep_alive == 0,
                           keep_alive=keep_alive, think=think)


def model_named(body: Any) -> str | None:
    """The body's `model` when it is a name, for looking up the model's defaults before the
    body is parsed (parse_* still refuse a missing or malformed one)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def parse_show(body: dict[str, Any]) -> str:
    """/api/show names its model in `model` (older clients send `name`)."""
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    return model
