"""Shaping Ollama API responses: NDJSON lines, stream chunks, and the final object with its
figures in integer nanoseconds (see /work/shared/OLLAMA-API.md for the field meanings).

tandem adds one field to final objects, `tandem`, with the request's serving figures (TTFT,
TPOT, ITL, queue time, workers, KV bytes moved to the decode worker, migrations, whether the
response cache answered); Ollama
clients ignore fields they do not know.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from coordinator.generation import Generation
from coordinator.metrics import RequestTimings


def created_at() -> str:
    """RFC 3339 in UTC with microseconds, as Ollama writes it: 2024-05-17T10:30:00.123456Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ndjson(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def error_body(message: str) -> dict[str, str]:
    return {"error": message}


def _ns(seconds: float | None) -> int:
    return max(0, round((seconds or 0.0) * 1e9))


def figures(t: RequestTimings) -> dict[str, int]:
    """Ollama's six figures. prompt_eval_count counts the whole prompt, prefix-cached tokens
    included; prompt_eval_duration is arrival to first token (queueing, prefill, KV hand-off)."""
    return {
        "total_duration": _ns(t.e2e),
        # The wait for a worker to load the model (service.py); 0 when one was ready, as it is
        # for every request once the workers are up: they keep the model resident.
        "load_duration": _ns(t.load_wait),
        "prompt_eval_count": t.prompt_tokens,
        "prompt_eval_duration": _ns(t.ttft if t.ttft is not None else t.e2e),
        "eval_count": t.output_tokens,
        "eval_duration": _ns(t.eval_time),
    }


def serving_figures(g: Generation) -> dict[str, Any]:
    t = g.timings
    return {
        "ttft_s": t.ttft, "tpot_s": t.tpot, "itl_s": [round(x, 6) for x in t.itl],
        "queue_s": t.queue_time, "cached_tokens": t.cached_tokens,
        "truncated_messages": t.truncated_messages, "truncated_tokens": t.truncated_tokens,
        "decode_worker": g.outcome.decode_worker or None,
        "prefill_worker": g.outcome.prefill_worker or None,
        # The prefill worker's own time for the request, as it reported (its queue and
        # passes, the KV hand-off overlapped): what benchmarks.profile_host sets against the
        # engine's pass. None for a local prefill.
        "prefill_worker_s": g.outcome.prefill_seconds if g.outcome.prefill_worker else None,
        "kv_bytes": g.outcome.kv_bytes, "migrations": g.outcome.migrations,
        # coordinator/response_cache.py: "hit" (replayed, no worker), "miss", "bypass"; None
        # with the cache off
        "cache": g.cache,
    }


def _message(content: str, tool_calls: list[dict[str, Any]] | None,
             thinking: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:  # coordinator/thinking.py: the answer's <think> block, when `think` asked
        message["thinking"] = thinking
    if tool_calls:  # coordinator/tool_calls.py's ollama_tool_calls
        message["tool_calls"] = tool_calls
    return message


def _logprobs(g: Generation | None) -> dict[str, Any]:
    """`logprobs` (coordinator/logprobs.py) of the tokens since the last chunk, when asked."""
    return {"logprobs": g.take_logprobs()} if g is not None and g.wants_logprobs else {}


def chat_chunk(model: str, content: str,
               tool_calls: list[dict[str, Any]] | None = None,
               g: Generation | None = None, thinking: str = "") -> dict[str, Any]:
    return {"model": model, "created_at": created_at(),
            "message": _message(content, tool_calls, thinking), "done": False, **_logprobs(g)}


def chat_final(model: str, g: Generation, content: str = "",
               tool_calls: list[dict[str, Any]] | None = None,
               thinking: str = "") -> dict[str, Any]:
    g.timings.finish()
    return {"model": model, "created_at": created_at(),
            "message": _message(content, tool_calls, thinking), "done": True,
            "done_reason": _with_done_reason(g.done_reason), **_logprobs(g), **figures(g.timings),
            "tandem": serving_figures(g)}


def chat_load(model: str, unload: bool = False) -> dict[str, Any]:
    """Empty `messages`: Ollama loads (or, with keep_alive 0, unloads) and answers once done
    (Coordinator.preload did it)."""
    return {"model": model, "created_at": created_at(),
            "message": {"role": "assistant", "content": ""}, "done": True,
            "done_reason": "unload" if unload else "load"}


def _with_done_reason(reason: str | None) -> str:
    return reason or "stop"


def generate_chunk(model: str, text: str, g: Generation | None = None,
                   thinking: str = "") -> dict[str, Any]:
    """`thinking`: Ollama's field beside `response`, only where there is some."""
    return {"model": model, "created_at": created_at(), "response": text,
            **({"thinking": thinking} if thinking else {}), "done": False, **_logprobs(g)}


def generate_final(model: str, g: Generation, text: str = "",
                   context: list[int] | None = None, thinking: str = "") -> dict[str, Any]:
    """`context` (prompt + output token ids) lets a client continue; None in raw mode."""
    g.timings.finish()
    body: dict[str, Any] = {"model": model, "created_at": created_at(), "response": text,
                            **({"thinking": thinking} if thinking else {}),
                            "done": True, "done_reason": _with_done_reason(g.done_reason),
                            **_logprobs(g)}
    if context is not None:
        body["context"] = context
    body.update(figures(g.timings))
    body["tandem"] = serving_figures(g)
    return body


def generate_load(model: str, unload: bool = False) -> dict[str, Any]:
    """Empty `prompt`: Ollama loads (or, with keep_alive 0, unloads) and answers at once."""
    return {"model": model, "created_at": created_at(), "response": "", "done": True,
            "done_reason": "unload" if unload else "load"}
