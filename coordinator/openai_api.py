"""The OpenAI-compatible surface, as pure functions: request bodies -> typed requests, and
tandem's results -> OpenAI's response, chunk and error shapes. Handlers: openai_routes.py.

Mapping onto tandem's (Ollama-named) sampling options, as Ollama's own OpenAI layer does:
`max_tokens` / `max_completion_tokens` -> num_predict, `temperature` (OpenAI's default 1.0),
`top_p` (default 1.0), `frequency_penalty`, `presence_penalty`, `seed`, `stop`; and vLLM's
extra sampling fields (the openai client's `extra_body`): `top_k` (off, 0, by default, as OpenAI
has none; vLLM's -1 is off too), `min_p`, `repetition_penalty` -> repeat_penalty, `min_tokens`.
`logit_bias` (OpenAI's), `stop_token_ids` and `ignore_eos` (vLLM's) go to SamplingParams too
(ranges there; Coordinator.prepare turns the last two into the stop set). Fields tandem
accepts but cannot honour are a 400 naming the field whenever they ask for anything (vLLM's
`prompt_logprobs`, chat's `echo`, `best_of` > 1, `suffix`, `use_beam_search`, ...:
`_UNIMPLEMENTED`), never silently dropped. Logprobs: chat's `logprobs: true` with
`top_logprobs` 0..20, completions' `logprobs` 0..20 (coordinator/logprobs.py shapes them).
`n` (1..MAX_N) asks for n choices, and /v1/completions' `prompt` may be a list (of strings,
or of token-id lists, as lm-eval batches them; a flat list of ids is one prompt): choices are
indexed prompt by prompt, n each (coordinator/choices.py), at most MAX_CHOICES in all.
Completions' `echo: true` puts the prompt before the completion and, with `logprobs`, the
prompt tokens' entries before the generated ones (SamplingParams.prompt_logprobs);
`max_tokens: 0` is allowed with echo only and scores the prompt alone (one token is generated
and dropped: a prefill always yields one). `response_format` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` are grammars
(coordinator/structured_output.py), one per request; `tools` and `tool_choice` are
coordinator/tool_calls.py's (a forced tool_choice is a grammar too). Two grammar sources in one
request are a 400 naming both; so is ignore_eos with one (a grammar ends on a stop token).
Fields that change nothing about the answer (`user`, `metadata`, `store`, vLLM's
`guided_decoding_backend`, ...) are accepted and ignored; unknown ones are logged and ignored,
as vLLM and Ollama do.
The served model's default options (an Ollama model's params layer, common/model_defaults.py)
lie under the request's fields, as in Ollama, whose OpenAI layer feeds the same handlers: a
model's stop, top_k, num_predict, num_ctx, penalties apply to a request that leaves them out,
but its temperature and top_p do not, since OpenAI's defaults (1.0) are always sent.
Ranges are SamplingParams' (common/sampling_params.py): `presence_penalty` and
`frequency_penalty` may lie in -100..100, wider than OpenAI's -2..2, since Ollama's OpenAI
layer passes them through. Null `content` is refused except on assistant messages, as OpenAI
does (the Ollama routes read it as "", as Ollama does).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from coordinator.ollama_request import RequestError, check_json_tree, check_messages
from coordinator.structured_output import openai_response_format, vllm_structured_outputs
from coordinator.tool_calls import (
    ToolCall, ToolChoice, check_tool_list, forced_grammar, openai_tool_calls, parse_tool_choice,
)
from common.errors import InvalidOptionError
from common.model_defaults import ModelDefaults
from common.logprobs import MAX_LOGPROBS
from common.sampling_params import MAX_COUNT, GrammarSpec, SamplingParams

log = logging.getLogger(__name__)

MAX_N = 16  # choices per prompt (`n`)
MAX_CHOICES = 64  # choices per request: prompts times n

_OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "seed": "seed",
                  "frequency_penalty": "frequency_penalty",
                  "presence_penalty": "presence_penalty", "stop": "stop",
                  # vLLM's extra sampling parameters
                  "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty",
                  "min_tokens": "min_tokens",
                  # tandem's: false opts the request out of speculative decoding
                  "speculative": "speculative",
                  # tandem's: the response cache may (true) or may not (false) answer it
                  "cache": "cache"}
_TOKEN_FIELDS = ("logit_bias", "stop_token_ids", "ignore_eos")  # SamplingParams' API-only fields
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                      "stream_options", "guided_decoding_backend"})
# field: (the values that ask for nothing, why any other is refused)
_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "prompt_logprobs": ((None, 0), "ask for prompt log probabilities with echo and logprobs on "
                        "/v1/completions"),  # vLLM
    "echo": ((None, False), "only /v1/completions repeats the prompt"),  # parse_completion honours it
    "best_of": ((None, 1), "tandem generates one completion per request"),
    "suffix": ((None, ""), "the served model does not support insert"),
    # honoured on /v1/chat/completions (reasoning_effort below)
    "reasoning_effort": ((None, "none", "minimal"),
                         "reasoning is served on /v1/chat/completions (reasoning_content)"),
    "modalities": ((None, ["text"]), "the served model answers in text only"),
    "audio": ((None,), "the served model answers in text only"),
    "prediction": ((None,), "tandem does no predicted-output decoding"),
    "web_search_options": ((None,), "tandem does not search the web"),
    # vLLM's extras that change the answer
    "use_beam_search": ((None, False), "tandem samples; it has no beam search"),
    "guided_whitespace_pattern": ((None,), "the grammar's own whitespace rules apply"),
}


@dataclass(frozen=True)
class OpenAIRequest:
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    params: SamplingParams
    messages: list[dict] | None = None  # chat completions
    prompt: str | list[int] | None = None  # completions: the first of `prompts`
    prompts: tuple[str | list[int], ...] = ()  # completions: every prompt, in index order
    n: int = 1  # choices per prompt
    tools: list[dict] | None = None
    tool_choice: ToolChoice = ToolChoice("auto")
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    score_only: bool = False  # completions, echo with max_tokens 0: the prompt alone
    cache_salt: str | None = None  # vLLM's: this request's own prefix-cache partition
    # reasoning_effort as Ollama's `think` (coordinator/thinking.py): None (unset), False
    # ("none", "minimal"), or "low" | "medium" | "high".
    think: bool | str | None = None


def _text_content(index: int, content: Any) -> Any:
    """OpenAI allows content as a list of parts; tandem's models take text parts only."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"messages[{index}].content: only text parts are supported, "
                               f"got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):  # never str(None): "None" would reach the model
            raise RequestError(f"messages[{index}].content[{j}].text must be a string, "
                               f"got {json.dumps(text)[:60]}")
        texts.append(text)
    return "".join(texts)


def _message(index: int, m: Any) -> Any:
    if not isinstance(m, dict):
        return m  # check_messages names the problem
    if m.get("content") is None and m.get("role") != "assistant":
        # OpenAI's rule: only an assistant message (one that carries tool_calls) may omit it.
        raise RequestError(f"messages[{index}].content must be a string or a list of text parts "
                           "(only assistant messages may have null content)")
    m = {**m, "content": _text_content(index, m.get("content"))}
    if m.get("role") == "developer":
        m["role"] = "system"
    for key in ("name", "tool_call_id"):  # the template renders them as text
        if m.get(key) is not None and not isinstance(m[key], str):
            raise RequestError(f"messages[{index}].{key} must be a string, "
                               f"got {json.dumps(m[key])[:60]}")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise RequestError(f"messages[{index}].tool_calls must be a list of objects")
    for call in calls or []:  # OpenAI sends arguments as a JSON string
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                raise RequestError("tool_calls arguments must be a JSON object") from None
            check_json_tree({"arguments": fn["arguments"]})
    return m


NO_DEFAULTS = ModelDefaults()


def _params(body: dict[str, Any], zero_tokens: bool = False,
            defaults: ModelDefaults = NO_DEFAULTS) -> SamplingParams:
    """zero_tokens: max_tokens 0 is allowed (echo scoring); it becomes num_predict 1, whose
    token the route drops. defaults: the model's options, under OpenAI's and the request's."""
    options: dict[str, Any] = {"top_k": 0, **defaults.options, "temperature": 1.0, "top_p": 1.0}
    for field, option in _OPTION_FIELDS.items():
        if body.get(field) is not None:
            options[option] = body[field]
    if options["top_k"] == -1:
        options["top_k"] = 0  # vLLM's "off"
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        low = 0 if zero_tokens else 1
        if (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                or not low <= max_tokens <= MAX_COUNT):
            raise RequestError(f"max_tokens must be an integer between {low} and {MAX_COUNT}"
                               f"{'' if zero_tokens else ' (0 needs echo)'}, "
                               f"got {json.dumps(max_tokens)[:60]}")
        options["num_predict"] = max(1, max_tokens)
    try:
        params = SamplingParams.from_options(options)
    except InvalidOptionError as exc:  # name the field as this client sent it
        raise InvalidOptionError(str(exc).replace("option 'repeat_penalty'",
                                                  "'repetition_penalty'")) from None
    params = replace(params, **{f: body[f] for f in _TOKEN_FIELDS if body.get(f) is not None})
    structured = _structured(body)
    if structured is None:
        return params
    if params.ignore_eos:
        raise RequestError(f"ignore_eos and {structured[0]} cannot be combined: the grammar "
                           "ends the answer on a stop token")
    return replace(params, grammar=structured[1])


def _structured(body: dict[str, Any]) -> tuple[str, GrammarSpec] | None:
    """The request's grammar and the field that asked for it (coordinator/structured_output.py):
    response_format or one of vLLM's fields; two of them are a 400 naming both."""
    found = vllm_structured_outputs(body)
    grammar = openai_response_format(body.get("response_format"))
    if grammar is not None:
        found.insert(0, ("response_format", grammar))
    if len(found) > 1:
        raise RequestError(f"{found[0][0]} and {found[1][0]} cannot be combined: ask for one "
                           "structured output")
    return found[0] if found else None


def _common(body: dict[str, Any], honoured: frozenset[str] = frozenset()
            ) -> tuple[str, bool, bool]:
    """`honoured`: _UNIMPLEMENTED fields the caller handles itself."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required")
    for field, (nothing, why) in _UNIMPLEMENTED.items():
        value = body.get(field)
        if field in honoured:
            continue
        if not any(value == v and type(value) is type(v) for v in nothing):
            raise RequestError(f"{field} is not supported: {why} "
                               f"(got {json.dumps(value)[:60]})")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {json.dumps(stream)}")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError("stream_options must be an object")
    for key in body:
        if key not in _IGNORED and key not in _KNOWN:
            log.warning("unknown field %r ignored", key)
    return model, stream, bool(stream_options.get("include_usage"))


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer between 1 and {MAX_N}, "
                           f"got {json.dumps(n)[:60]}")
    return n


def _prompts(prompt: Any) -> tuple[str | list[int], ...]:
    """A string, a list of token ids, or a list of either: the prompts, each checked."""
    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)

    if (isinstance(prompt, str) and prompt) or is_ids(prompt):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        for i, p in enumerate(prompt):
            if not ((isinstance(p, str) and p) or is_ids(p)):
                raise RequestError(f"prompt[{i}] must be a non-empty string or a non-empty "
                                   "list of token ids")
        return tuple(prompt)
    raise RequestError("prompt must be a non-empty string, a list of token ids, or a list of "
                       "strings or of token-id lists")


def _count(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise RequestError(f"{field} must be an integer between 0 and {MAX_LOGPROBS}, "
                           f"got {json.dumps(value)[:60]}")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs: true` and `top_logprobs` -> SamplingParams.logprobs; top_logprobs
    needs logprobs true, as OpenAI and vLLM require."""
    wanted, top = body.get("logprobs"), _count(body, "top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false, got {json.dumps(wanted)[:60]}")
    if top and not wanted:
        raise RequestError("top_logprobs requires logprobs: true")
    return (top or 0) if wanted else None


_KNOWN = frozenset({"model", "messages", "prompt", "stream", "n", "response_format", "cache_salt",
                    "logprobs", "top_logprobs",
                    "max_tokens", "max_completion_tokens", "tools", "tool_choice", *_OPTION_FIELDS,
                    *_TOKEN_FIELDS, *_GUIDED, *_UNIMPLEMENTED})


def parse_messages(body: dict[str, Any], max_messages: int
                   ) -> tuple[list[dict], list[dict] | None]:
    """A chat body's `messages` (OpenAI's content parts and roles -> the template's) and
    `tools`, checked; /v1/chat/completions and vLLM's /tokenize."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list")
    messages = check_messages([_message(i, m) for i, m in enumerate(raw)], max_messages)
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects")
    check_tool_list(tools)
    return messages, tools


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def reasoning_effort(body: dict[str, Any]) -> bool | str | None:
    """OpenAI's reasoning_effort as Ollama's `think`: "none" and "minimal" turn thinking off
    (a model without thinking answers as usual), a level turns it on at that level."""
    value = body.get("reasoning_effort")
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise RequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                           f"got {json.dumps(value)[:60]}")
    return False if value in ("none", "minimal") else value


def parse_chat_completion(body: dict[str, Any], max_messages: int,
                          defaults: ModelDefaults = NO_DEFAULTS) -> OpenAIRequest:
    model, stream, usage = _common(body, honoured=frozenset({"reasoning_effort"}))
    think = reasoning_effort(body)
    messages, tools = parse_messages(body, max_messages)
    # Tool calls (coordinator/tool_calls.py): a forced tool_choice is a grammar; "none"
    # renders no tools, so the model cannot call one.
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    params = replace(_params(body, defaults=defaults), logprobs=_chat_logprobs(body))
    if choice.forced:
        if params.ignore_eos:
            raise RequestError("ignore_eos and a forced tool_choice cannot be combined: the "
                               "grammar ends the answer on a stop token")
        if params.grammar is not None:
            raise RequestError(f"{_structured(body)[0]} and a forced tool_choice cannot be "
                               "combined")
        parallel = body.get("parallel_tool_calls") is not False
        params = replace(params, grammar=forced_grammar(tools, choice, parallel))
    return OpenAIRequest(model=model, stream=stream, include_usage=usage, params=params,
                         n=_n(body), messages=messages,
                         tools=(tools or None) if choice.mode != "none" else None,
                         tool_choice=choice, cache_salt=_cache_salt(body), think=think)


def parse_completion(body: dict[str, Any], defaults: ModelDefaults = NO_DEFAULTS
                     ) -> OpenAIRequest:
    model, stream, usage = _common(body, honoured=frozenset({"echo"}))
    echo = False if body.get("echo") is None else body["echo"]
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {json.dumps(echo)[:60]}")
    prompts, n = _prompts(body.get("prompt")), _n(body)
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(f"prompt has {len(prompts)} prompts and n is {n}: at most "
                           f"{MAX_CHOICES} choices per request")
    logprobs = _count(body, "logprobs")
    params = replace(_params(body, zero_tokens=echo, defaults=defaults), logprobs=logprobs,
                     prompt_logprobs=logprobs if echo else None)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return OpenAIRequest(model=model, stream=stream, include_usage=usage, params=params,
                         prompt=prompts[0], prompts=prompts, n=n, echo=echo,
                         score_only=echo and max_tokens == 0,
                         cache_salt=_cache_salt(body))


def _cache_salt(body: dict[str, Any]) -> str | None:
    value = body.get("cache_salt")
    if value is not None and not (isinstance(value, str) and value):
        raise RequestError(f"cache_salt must be a non-empty string, got {json.dumps(value)[:60]}")
    return value


# ---- responses -----------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def finish_reason(done_reason: str | None) -> str:
    """OpenAI's finish_reason; "tool_calls" is passed in by the routes when calls were made."""
    return done_reason if done_reason in ("length", "tool_calls") else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_choice(index: int, content: str, reason: str | None,
                tool_calls: list[ToolCall] | None = None,
                logprobs: list[dict[str, Any]] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
    """`logprobs`: coordinator/logprobs.py's content entries, None when not asked for.
    `reasoning`: the answer's thinking, as vLLM's message.reasoning_content (None: not asked)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:  # OpenAI: content null when the answer is only calls
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": openai_tool_calls(tool_calls)}
        reason = "tool_calls"
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": finish_reason(reason)}


def chat_completion(rid: str, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": "fp_tandem", "choices": choices,
            "usage": usage_}


def chat_chunk(rid: str, model: str, delta: dict[str, Any],
               reason: str | None = None, done: bool = False,
               logprobs: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "system_fingerprint": "fp_tandem",
            "choices": [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason(reason) if done else None}]}


def completion_choice(index: int, text: str, reason: str | None, done: bool = True,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason(reason) if done else None}


def completion(rid: str, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None, chunk: bool = False) -> dict[str, Any]:
    """The whole answer (with usage) or, `chunk`, one stream chunk (without)."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": "fp_tandem", "choices": choices}
    if not chunk:
        body["usage"] = usage_
    return body


def usage_chunk(rid: str, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_}


def models_list(models: list[tuple[str, int]]) -> dict[str, Any]:
    """/v1/models: (name, created) of every model served."""
    return {"object": "list", "data": [model_entry(name, created) for name, created in models]}


def model_entry(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tandem"}


# OpenAI answers a wrong or missing key (401) with type invalid_request_error too.
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                403: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "server_error"}


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                      "param": None, "code": code}}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode()
