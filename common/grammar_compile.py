"""A GrammarSpec as an llguidance grammar, and whether it compiles: torch-free, so the
coordinator checks a request's grammar in its own process before admitting it, with the very
function the workers compile it with (engine/grammar.py).

    "json"          any JSON object: the JSON schema {"type": "object"}
    "json_schema"   llguidance's JSON-schema compiler; keywords it does not implement (e.g.
                    uniqueItems, if/then, not) are refused, never silently left unenforced
    "lark"          llguidance's Lark syntax (`start:` is the root rule)
    "regex"         the whole output matches the regular expression (Rust regex syntax)

Whitespace: JSON grammars allow at most MAX_JSON_WHITESPACE whitespace characters between two
tokens of JSON; an unbounded run is how small models fail under a JSON grammar (newlines until
the token limit).

Closed objects: an object schema that lists `properties` and says nothing of
`additionalProperties` (nor patternProperties, unevaluatedProperties) allows no other keys, as
Ollama (llama.cpp's converter) and OpenAI's structured outputs read it; JSON Schema's own
default (any other key) is how a small model wanders off into made-up keys. An object schema
without `properties` (kind "json" included) stays open.

The check needs no vocabulary (llguidance's LLMatcher.validate_grammar without a tokenizer):
the grammar is parsed and its lexer built, which is where user errors show. Under a
millisecond for ordinary schemas, but a large grammar can take longer: the coordinator calls
`check_grammar` off its event loop (Coordinator.submit). Verdicts are cached (LRU) by spec.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from common.errors import InvalidOptionError
from common.sampling_params import GrammarSpec

MAX_JSON_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens
_JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
_ANY_OBJECT = '{"type":"object"}'  # kind "json": Ollama's and OpenAI's JSON mode is an object
_NAMES = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regular expression"}


def grammar_text(spec: GrammarSpec) -> str:
    """`spec` as llguidance's grammar text (what LLMatcher takes). Raises ValueError for a
    schema nested too deeply to walk (or not JSON, which GrammarSpec already refuses)."""
    import llguidance  # noqa: PLC0415 - only once a grammar is used (~30 ms, no torch)

    matcher = llguidance.LLMatcher
    if spec.kind in ("json", "json_schema"):
        schema = _ANY_OBJECT if spec.kind == "json" else _closed_text(spec.value)
        return matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if spec.kind == "lark":
        return matcher.grammar_from_lark(spec.value)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.value)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


# Where a JSON schema holds subschemas: a map of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
               "unevaluatedProperties", "contains", "propertyNames", "not", "if", "then", "else")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _closed(schema: Any) -> Any:
    """`schema` with every object schema that lists properties closed (module docstring)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):  # items: a list in drafts before 2020-12
            sub = out[key]
            out[key] = [_closed(s) for s in sub] if isinstance(sub, list) else _closed(sub)
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _closed_text(schema: str) -> str:
    try:
        closed = _closed(json.loads(schema))
    except RecursionError:
        raise ValueError("the JSON schema is nested too deeply") from None
    return json.dumps(closed, ensure_ascii=False, separators=(",", ":"))


def clean_error(kind: str, message: str) -> str:
    """llguidance's message in one line: its first line, plus the regex parser's own reason
    (an `error:` line under a caret drawing), without the position inside the Lark wrapper
    that a regex gets."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines or not lines[0]:
        return "the grammar is invalid"
    text = lines[0]
    reason = next((line[len("error:"):].strip() for line in lines[1:]
                   if line.startswith("error:")), "")
    if reason:
        text = f"{text.rstrip(':')}: {reason}"
    if kind == "regex" and text.startswith("at "):
        text = text.split(": ", 1)[-1].replace(" (in regex): regex parse error", "")
    return text


@lru_cache(maxsize=256)
def compile_error(spec: GrammarSpec) -> str | None:
    """Why `spec` does not compile (llguidance's words, one line), or None when it does."""
    if spec.kind == "json":
        return None  # tandem's own grammar
    import llguidance  # noqa: PLC0415

    try:
        text = grammar_text(spec)
    except ValueError as exc:
        return clean_error(spec.kind, str(exc))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return clean_error(spec.kind, messages[0] if messages else "") if is_error else None


def check_grammar(spec: GrammarSpec) -> None:
    """Raises InvalidOptionError (a 400) when `spec` does not compile."""
    error = compile_error(spec)
    if error is not None:
        name = _NAMES.get(spec.kind, "grammar")
        raise InvalidOptionError(f"the {name} does not compile: {error}")
