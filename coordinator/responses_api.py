"""OpenAI's Responses API (POST /v1/responses), minimal: text in, text out, as pure functions:
the request body -> chat messages and sampling parameters, and tandem's answer -> the
Response object and its stream events. The handler is coordinator/responses_routes.py.

    input          a string (one user message), or a list of messages ({"role", "content"}
                   with content a string or input_text/output_text parts; `"type": "message"`
                   allowed); `instructions` is a system message before them
    sampling       max_output_tokens, temperature (default 1), top_p (default 1)
    answer         one `message` output item with one `output_text` part; status "completed",
                   or "incomplete" with incomplete_details.reason "max_output_tokens"
    stream         response.created, response.in_progress, response.output_item.added,
                   response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done,
                   response.output_item.done, then response.completed (or
                   response.incomplete); each `event: TYPE` with a sequence_number

Refused with a 400 naming the field, never dropped: tools, previous_response_id and
conversation (no stored responses), a text.format other than text, reasoning, background,
and input items other than messages with text (images, files, function calls). Fields that
change nothing (store, metadata, user, truncation, parallel_tool_calls, ...) are ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from coordinator.ollama_request import RequestError
from common.model_defaults import ModelDefaults
from common.sampling_params import MAX_COUNT, SamplingParams

log = logging.getLogger(__name__)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED = frozenset({"store", "metadata", "user", "truncation", "parallel_tool_calls",
                      "service_tier", "include", "prompt_cache_key", "safety_identifier",
                      "tool_choice", "top_logprobs", "stream_options"})
# field: (the values that ask for nothing, why any other is refused)
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((None, []), "tools are not supported on /v1/responses yet (use "
                          "/v1/chat/completions)"),
    "previous_response_id": ((None,), "tandem stores no responses; send the whole input"),
    "conversation": ((None,), "tandem stores no conversations; send the whole input"),
    "reasoning": ((None,), "the served model does not reason"),
    "background": ((None, False), "tandem answers in the foreground only"),
    "prompt": ((None,), "tandem has no stored prompt templates"),
}


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    stream: bool
    messages: list[dict]  # the chat the template renders
    params: SamplingParams
    instructions: str | None
    max_output_tokens: int | None


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{j}]: only text parts are supported, "
                               f"got {json.dumps(kind)[:40]}")
        texts.append(part["text"])
    return "".join(texts)


def _messages(value: Any) -> list[dict]:
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input must be a non-empty string or a non-empty list of messages")
    out = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind != "message":
            raise RequestError(f"{where}: input items of type {json.dumps(kind)[:40]} are not "
                               "supported (messages with text only)")
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise RequestError(f"{where}.role must be one of {', '.join(_ROLES)}, "
                               f"got {json.dumps(item.get('role'))[:40]}")
        out.append({"role": role, "content": _content(where, item.get("content"))})
    return out


def _number(body: dict[str, Any], field: str, default: float, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{field} must be a number between {low:g} and {high:g}, "
                           f"got {json.dumps(value)[:60]}")
    return float(value)


def parse_responses(body: dict[str, Any], max_messages: int,
                    defaults: ModelDefaults = ModelDefaults()) -> ResponsesRequest:
    """defaults: the model's options, under OpenAI's and the request's (as on
    /v1/chat/completions: coordinator/openai_api.py)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    for field, (nothing, why) in _REFUSED.items():
        value = body.get(field)
        if not any(value == v and type(value) is type(v) for v in nothing):
            raise RequestError(f"{field} is not supported: {why}")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and fmt != {"type": "text"}):
            raise RequestError("text.format is not supported: only {\"type\": \"text\"} "
                               "(structured output: use /v1/chat/completions' response_format)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {json.dumps(stream)[:60]}")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string")
    messages = _messages(body.get("input"))
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    if len(messages) > max_messages:
        raise RequestError(f"input has {len(messages)} messages; the limit is {max_messages}")
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_COUNT):
        raise RequestError(f"max_output_tokens must be an integer between 1 and {MAX_COUNT}, "
                           f"got {json.dumps(limit)[:60]}")
    options: dict[str, Any] = {"top_k": 0, **defaults.options,
                               "temperature": _number(body, "temperature", 1.0, 0, 2),
                               "top_p": _number(body, "top_p", 1.0, 0, 1)}
    if limit is not None:
        options["num_predict"] = limit
    known = {"model", "input", "instructions", "stream", "text", "max_output_tokens",
             "temperature", "top_p", *_REFUSED}
    for key in body:
        if key not in known and key not in _IGNORED:
            log.warning("unknown field %r ignored", key)
    return ResponsesRequest(model, stream, messages, SamplingParams.from_options(options),
                            instructions, limit)


# ---- the answer ------------------------------------------------------------------------------

def new_ids() -> tuple[str, str]:
    """The response's id and its message item's."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, done: bool) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [] if text is None else [output_text(text)]}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def status_of(done_reason: str | None) -> str:
    """"incomplete" when the answer was cut at max_output_tokens (or the context)."""
    return "incomplete" if done_reason == "length" else "completed"


def response(rid: str, req: ResponsesRequest, created: int, status: str,
             output: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "model": req.model,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "output": output, "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
            "temperature": req.params.temperature, "top_p": req.params.top_p,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
            "usage": usage_}


def now() -> int:
    return int(time.time())


class EventStream:
    """The stream's events as SSE bytes, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
