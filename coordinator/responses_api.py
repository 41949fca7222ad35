"""OpenAI's Responses API (POST /v1/responses), as pure functions: the request body -> chat
messages, tools and sampling parameters, and tandem's answer -> the Response object's output
items and its stream events. The handler is coordinator/responses_routes.py.

    input          a string (one user message), or a list of items: messages ({"role",
                   "content"} with content a string or input_text/output_text parts;
                   `"type": "message"` allowed), `function_call` items (the model's earlier
                   calls: an assistant message's tool_calls) and `function_call_output` items
                   (their results: tool messages); `instructions` is a system message first
    tools          function tools ({"type": "function", "name", "description", "parameters"}),
                   rendered by the template and parsed out of the answer as on
                   /v1/chat/completions (coordinator/tool_calls.py); tool_choice "auto",
                   "none", "required" or {"type": "function", "name"} (forced: a grammar);
                   parallel_tool_calls false allows one call
    text.format    {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
                   "name", "schema"}: the answer constrained by that grammar
    sampling       max_output_tokens, temperature (default 1), top_p (default 1)
    answer         output items in order: a `message` with one `output_text` part for text,
                   a `function_call` item (call_id, name, arguments as a JSON string) per call;
                   status "completed", or "incomplete" with incomplete_details.reason
                   "max_output_tokens"
    stream         response.created, response.in_progress, then per item: a message's
                   output_item.added, content_part.added, output_text.delta ...,
                   output_text.done, content_part.done, output_item.done; a call's
                   output_item.added, function_call_arguments.delta (the whole arguments, as
                   a call is parsed once it closed), function_call_arguments.done,
                   output_item.done; then response.completed (or response.incomplete); each
                   `event: TYPE` with a sequence_number

Refused with a 400 naming the field, never dropped: tools of other types (web search, file
search, ...), previous_response_id and conversation (no stored responses), reasoning,
background, and input items other than messages with text and function calls (images,
files). Fields that change nothing (store, metadata, user, truncation, ...) are ignored.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any


from coordinator.ollama_request import RequestError, check_json_tree
from coordinator.structured_output import openai_response_format
from coordinator.tool_calls import (
    ToolCall, ToolChoice, check_tool_list, forced_grammar, parse_tool_choice,
)
from common.model_defaults import ModelDefaults
from common.sampling_params import MAX_COUNT, SamplingParams

log = logging.getLogger(__name__)

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED = frozenset({"store", "metadata", "user", "truncation", "service_tier", "include",
                      "prompt_cache_key", "safety_identifier", "top_logprobs",
                      "stream_options"})
# field: (the values that ask for nothing, why any other is refused)
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
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
    tools: list[dict] | None = None  # /v1/chat/completions' shape, for the template and parser
    tool_choice: ToolChoice = ToolChoice("auto")
    # What the Response object repeats back, in the Responses API's own shapes
    echo_tools: tuple[dict, ...] = ()
    echo_tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text_format: dict | None = None


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


def _string(where: str, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "output" and not value):
        raise RequestError(f"{where}.{key} must be a string")
    return value


def _function_call(where: str, item: dict) -> dict:
    """A `function_call` input item as an assistant message's tool call (arguments parsed)."""
    arguments = _string(where, item, "arguments")
    try:
        args = json.loads(arguments)
    except (ValueError, RecursionError):
        raise RequestError(f"{where}.arguments must be a JSON object") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.arguments must be a JSON object")
    check_json_tree({"arguments": args})
    return {"id": _string(where, item, "call_id"), "type": "function",
            "function": {"name": _string(where, item, "name"), "arguments": args}}


def _messages(value: Any) -> list[dict]:
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input must be a non-empty string or a non-empty list of messages")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "function_call":
            # Calls follow the assistant's text they came with (one message, as chat sends).
            call = _function_call(where, item)
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"),
                        "content": _string(where, item, "output")})
            continue
        if kind != "message":
            raise RequestError(f"{where}: input items of type {json.dumps(kind)[:40]} are not "
                               "supported (messages with text, function calls and their "
                               "outputs)")
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


def _tools(value: Any) -> tuple[list[dict] | None, tuple[dict, ...]]:
    """Function tools in /v1/chat/completions' shape, and as the response repeats them."""
    if value is None or value == []:
        return None, ()
    if not isinstance(value, list):
        raise RequestError("tools must be a list of objects")
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}]: tools of type {json.dumps(kind)[:40]} are not "
                               "supported (function tools only)")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{i}].name is required")
        function = {k: tool[k] for k in ("name", "description", "parameters")
                    if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    check_tool_list(tools)
    return tools, tuple({"strict": None, "description": None, "parameters": None, **t}
                        for t in value)


def _tool_choice(value: Any, tools: list[dict] | None) -> ToolChoice:
    """The Responses API's tool_choice ({"type": "function", "name"} for a named one)."""
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("name"), str)):
        value = {"type": "function", "function": {"name": value["name"]}}
    elif value is not None and not (isinstance(value, str)
                                    and value in ("auto", "none", "required")):
        raise RequestError('tool_choice must be "auto", "none", "required" or '
                           '{"type": "function", "name": ...}, '
                           f"got {json.dumps(value)[:60]}")
    return parse_tool_choice(value, tools)


def _text_format(text: Any) -> dict | None:
    """text.format as given (None: plain text); its grammar comes from _grammar."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise RequestError("text must be an object with an optional format object")
    return None if fmt is None or fmt == {"type": "text"} else fmt


def _grammar(fmt: dict | None):
    """The grammar of a text.format: /v1/chat/completions' response_format with the schema
    at the top level (the Responses API's shape)."""
    if fmt is None:
        return None
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema must be a JSON schema object")
        return openai_response_format({"type": "json_schema",
                                       "json_schema": {"schema": fmt["schema"]}})
    if fmt.get("type") not in ("text", "json_object"):
        raise RequestError('text.format.type must be "text", "json_object" or "json_schema", '
                           f"got {json.dumps(fmt.get('type'))[:60]}")
    return openai_response_format(fmt)


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
    text_format = _text_format(body.get("text"))
    grammar = _grammar(text_format)
    tools, echo_tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, "
                           f"got {json.dumps(parallel)[:60]}")
    if choice.forced and grammar is not None:
        raise RequestError("text.format and a forced tool_choice cannot be combined")
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
             "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", *_REFUSED}
    for key in body:
        if key not in known and key not in _IGNORED:
            log.warning("unknown field %r ignored", key)
    params = SamplingParams.from_options(options)
    if choice.forced:  # the whole output is the call (coordinator/tool_calls.py)
        grammar = forced_grammar(tools or [], choice, parallel)
    if grammar is not None:
        params = replace(params, grammar=grammar)
    return ResponsesRequest(model, stream, messages, params, instructions, limit,
                            tools if choice.mode != "none" else None, choice, echo_tools,
                            body.get("tool_choice") or "auto", parallel, text_format)


# ---- the answer ------------------------------------------------------------------------------

def new_ids() -> tuple[str, str]:
    """The response's id and its (first) message item's."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def new_item_id(kind: str = "msg") -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def function_call_item(item_id: str, call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False), "status": "completed"}


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
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": req.echo_tool_choice, "tools": list(req.echo_tools),
            "temperature": req.params.temperature, "top_p": req.params.top_p,
            "text": {"format": req.text_format or {"type": "text"}}, "truncation": "disabled",
            "metadata": {}, "usage": usage_}


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
