"""Tool calls: which chat templates support tools, how their models write a call, the grammar
that forces one (OpenAI's `tool_choice`), and the parser that turns output text into calls,
whole or streamed.

Support: a template supports tools when it reads the `tools` variable (jinja2's own analysis
of the template, not a text search); a request with tools for any other template is refused as
Ollama refuses it ("<model> does not support tools", 400), and /api/show lists "tools" among
the capabilities only then.

How a model writes a call, from its template (as the template teaches it):

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated
             (Qwen2.5, Hermes, SmolLM3-style templates: the template mentions <tool_call>)
    mistral  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    json     a bare {"name": ..., "parameters": {...}} (Llama 3.1/3.2; <|python_tag|> first,
             when the tokenizer keeps it, is dropped)

Forced calls (tool_choice "required" or a named function; vLLM's approach): the output is
constrained by a JSON schema instead of the template's markup, so it is a call whatever the
model would write. Named: the output is the function's arguments object. Required: an array
of {"name": <one of the tools>, "arguments": {...}} objects, at least one.

Streaming: text that cannot be part of a call streams as content at once; from the first
character that may begin a call's markup, text is held until the call ends (then emitted as
a call) or turns out to be content after all.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta

from common.errors import InvalidOptionError
from common.sampling_params import GrammarSpec


@lru_cache(maxsize=8)
def supports_tools(template: str | None) -> bool:
    if not template:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


@dataclass(frozen=True)
class CallFormat:
    name: str  # "hermes" | "mistral" | "json"
    start: str  # the markup a call starts with ("" for a bare JSON call)
    end: str  # the markup that closes one call ("": the call runs to the end of the output)
    arguments_key: str  # what the template calls the arguments


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "", "arguments")
BARE_JSON = CallFormat("json", "", "", "parameters")


def call_format(template: str | None) -> CallFormat:
    template = template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    return BARE_JSON


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


MAX_TOOLS = 128  # tools in one request: each is rendered into the prompt and may be forced


def check_tool_list(tools: list[dict] | None) -> None:
    """Each tool names its function (a 400 otherwise): forcing and parsing rely on it. At most
    MAX_TOOLS of them."""
    if tools and len(tools) > MAX_TOOLS:
        raise InvalidOptionError(f"a request takes at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidOptionError(f"tools[{i}].function.name is required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidOptionError(f"tools[{i}].function.parameters must be a JSON schema object")


def require_tool_support(tools: list[dict] | None, template: str | None, model: str) -> None:
    """Tools for a template that cannot render them: refused as Ollama refuses them (400)."""
    if tools and not supports_tools(template):
        raise InvalidOptionError(f"{model} does not support tools")


# ---- tool_choice ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required" | "named"
    name: str = ""  # the function, for "named"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def parse_tool_choice(value: Any, tools: list[dict] | None) -> ToolChoice:
    """OpenAI's tool_choice: "auto" (default), "none", "required", or
    {"type": "function", "function": {"name": ...}}."""
    if value is None:
        return ToolChoice("auto")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif (isinstance(value, dict) and value.get("type") == "function"
          and isinstance(value.get("function"), dict)
          and isinstance(value["function"].get("name"), str)):
        choice = ToolChoice("named", value["function"]["name"])
    else:
        raise InvalidOptionError('tool_choice must be "auto", "none", "required" or '
                           '{"type": "function", "function": {"name": ...}}, '
                           f"got {json.dumps(value)[:60]}")
    if choice.forced and not tools:
        raise InvalidOptionError(f"tool_choice {json.dumps(value)[:60]} needs tools")
    if choice.mode == "named" and choice.name not in _names(tools or []):
        raise InvalidOptionError(f"tool_choice names {json.dumps(choice.name)[:60]}, which is not "
                           "among the tools")
    return choice


def _names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools if isinstance(t.get("function"), dict)]


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def forced_grammar(tools: list[dict], choice: ToolChoice,
                   parallel: bool = True) -> GrammarSpec | None:
    """The JSON schema a forced tool_choice constrains the output to (module docstring);
    `parallel` False (OpenAI's parallel_tool_calls): at most one call."""
    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return GrammarSpec("json_schema", _parameters(tool))
    if choice.mode == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": _parameters(t)},
                  "required": ["name", "arguments"]} for t in tools]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", schema)
    return None


# ---- parsing ------------------------------------------------------------------------------------

def _call(obj: Any, key: str, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _calls(text: str, key: str, names: frozenset[str]) -> list[ToolCall] | None:
    """Every call in `text` (one object, or a list of them), or None if it is not calls of
    the request's tools."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG):]
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, key, names) for item in items]
    return calls if calls and all(c is not None for c in calls) else None


_PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's "a call follows", when the text keeps it


class ToolCallParser:
    """Output text -> (content, tool calls) for a request with `tools`. `push` a piece at a
    time, then `finish`; each returns the content that may be shown now and the calls
    completed since. Only calls of the request's own tools count: anything else is content.

    An output that starts (after whitespace) with `{` or `[` is held to its end and is a call
    if it parses as one, whatever the template's markup: Llama 3.1's bare JSON, and a call
    that a JSON schema (Ollama's `format`) forced. Otherwise, for a template with markup,
    content streams and each marked call is held until it closes."""

    def __init__(self, fmt: CallFormat, tools: list[dict],
                 choice: ToolChoice = ToolChoice("auto")) -> None:
        self.fmt = fmt
        self.choice = choice
        self.names = frozenset(_names(tools))
        self._buf = ""
        self._mode = "start"  # "start" (undecided) | "json" (holding all) | "text" | "call"

    def push(self, piece: str) -> tuple[str, list[ToolCall]]:
        self._buf += piece
        if self.choice.forced:
            return "", []  # the whole output is the call: finish parses it
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG):].lstrip()
            start = self.fmt.start
            if not head or _PYTHON_TAG.startswith(head) or (start and start.startswith(head)
                                                             and len(head) < len(start)):
                return "", []  # too little to tell yet
            self._mode = "text" if (start and head.startswith(start)) or head[0] not in "{[" \
                else "json"
        if self._mode == "json":
            return "", []
        content, calls = "", []
        while True:
            if self._mode == "text":
                at = self._buf.find(self.fmt.start) if self.fmt.start else -1
                if at < 0:
                    keep = _partial_suffix(self._buf, self.fmt.start)
                    content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, calls
                content += self._buf[:at]
                self._buf = self._buf[at + len(self.fmt.start):]
                self._mode = "call"
            end = self._buf.find(self.fmt.end) if self.fmt.end else -1
            if end < 0:
                return content, calls  # open: the rest of the output, or more to come
            body, self._buf = self._buf[:end], self._buf[end + len(self.fmt.end):]
            self._mode = "text"
            parsed = _calls(body, self.fmt.arguments_key, self.names)
            if parsed is None:
                content += self.fmt.start + body + self.fmt.end  # not a call after all
            else:
                calls += parsed

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if self.choice.mode == "named":
            try:
                args = json.loads(text)
            except (ValueError, RecursionError):
                return text, []  # e.g. cut off by the token limit
            return ("", [ToolCall(self.choice.name, args)]) if isinstance(args, dict) else (text, [])
        if self.choice.mode == "required" or self._mode in ("json", "call"):
            calls = _calls(text, self.fmt.arguments_key, self.names)
            if calls is not None:
                return "", calls
            return (self.fmt.start if self._mode == "call" else "") + text, []
        return text, []

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output at once (push + finish); content that is only whitespace around the
        calls is dropped."""
        content, calls = self.push(text)
        tail, more = self.finish()
        content, calls = content + tail, calls + more
        return (content if content.strip() or not calls else ""), calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    if not marker:
        return 0
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---- response shapes ------------------------------------------------------------------------------

def ollama_tool_calls(calls: list[ToolCall], first_index: int = 0) -> list[dict[str, Any]]:
    return [{"function": {"index": first_index + i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def openai_tool_calls(calls: list[ToolCall], first_index: int | None = None) -> list[dict[str, Any]]:
    """OpenAI's tool_calls (arguments as a JSON string); `first_index` set: stream deltas,
    which carry each call's index."""
    out = []
    for i, c in enumerate(calls):
        entry: dict[str, Any] = {"id": c.id, "type": "function",
                                 "function": {"name": c.name,
                                              "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        if first_index is not None:
            entry = {"index": first_index + i, **entry}
        out.append(entry)
    return out
