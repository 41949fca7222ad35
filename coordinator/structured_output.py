"""The APIs' structured-output fields -> the GrammarSpec that the workers' sampler enforces
(engine/grammar.py).

    Ollama  `format`: "json"                        -> GrammarSpec("json"): any JSON object
            `format`: {JSON schema}                 -> GrammarSpec("json_schema", schema)
    OpenAI  `response_format`: {"type": "text"}     -> none
            {"type": "json_object"}                 -> GrammarSpec("json")
            {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                    -> GrammarSpec("json_schema", schema)
                                                       (no "schema": any JSON object)

    vLLM    `guided_json` / `structured_outputs.json`: a schema (object or JSON text)
                                                    -> GrammarSpec("json_schema", schema)
            `guided_regex` / `structured_outputs.regex`  -> GrammarSpec("regex", pattern)
            `guided_choice` / `structured_outputs.choice`: ["a", "b"]
                                                    -> GrammarSpec("regex", "a|b"), escaped:
                                                       the answer is one choice, unquoted
            `guided_grammar` / `structured_outputs.grammar`
                                                    -> GrammarSpec("lark", text): llguidance's
                                                       Lark; GBNF (`::=`) is refused, and any
                                                       other text that does not compile (400)
            `structured_outputs.json_object`: true  -> GrammarSpec("json")

The OpenAI routes allow one of these per request (coordinator/openai_api.py names both of any
two). A structured_outputs key that would change the answer and is not listed here (vLLM's
`structural_tag`, `whitespace_pattern`, ...) is refused; `disable_fallback` and the backend
choice change nothing here and are ignored.

A shape error is an InvalidOptionError (400) here; a schema that does not compile is refused (400)
by Coordinator.submit, which asks llguidance in-process (common/grammar_compile.py). OpenAI's
`strict` changes nothing: tandem always enforces the schema (a keyword llguidance cannot enforce
is refused, not ignored).
"""

from __future__ import annotations

import json
from typing import Any

from common.errors import InvalidOptionError
from common.sampling_params import GrammarSpec


def ollama_format(value: Any) -> GrammarSpec | None:
    if value is None or value == "":
        return None
    if value == "json":
        return GrammarSpec("json")
    if isinstance(value, dict):
        return GrammarSpec("json_schema", value)
    raise InvalidOptionError(f'format must be "json" or a JSON schema object, '
                       f"got {json.dumps(value)[:60]}")


def openai_response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidOptionError("response_format.json_schema must be an object with the schema "
                               "under 'schema'")
        schema = spec.get("schema")
        return GrammarSpec("json") if schema is None else GrammarSpec("json_schema", schema)
    raise InvalidOptionError('response_format.type must be "text", "json_object" or "json_schema", '
                       f"got {json.dumps(kind if isinstance(value, dict) else value)[:60]}")


_GUIDED_KINDS = ("json", "regex", "choice", "grammar")
_NO_EFFECT = frozenset({"disable_fallback", "backend", "_backend"})
# What Rust's regex::escape escapes (llguidance's regex syntax), so an escaped choice always parses.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def vllm_structured_outputs(body: dict[str, Any]) -> list[tuple[str, GrammarSpec]]:
    """vLLM's structured-output fields that `body` sets, each as (field name, grammar), in the
    order of the module docstring's table; several is the caller's error to report."""
    found = [(f"guided_{kind}", _guided(f"guided_{kind}", kind, body[f"guided_{kind}"]))
             for kind in _GUIDED_KINDS if body.get(f"guided_{kind}") is not None]
    outputs = body.get("structured_outputs")
    if outputs is None:
        return found
    if not isinstance(outputs, dict):
        raise InvalidOptionError(f"structured_outputs must be an object, "
                                 f"got {json.dumps(outputs)[:60]}")
    for key, value in outputs.items():
        name = f"structured_outputs.{key}"
        if key in _GUIDED_KINDS and value is not None:
            found.append((name, _guided(name, key, value)))
        elif key == "json_object" and value is not None:
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{name} must be true or false, "
                                         f"got {json.dumps(value)[:60]}")
            if value:
                found.append((name, GrammarSpec("json")))
        elif key not in _GUIDED_KINDS and key not in _NO_EFFECT and value not in (None, False):
            raise InvalidOptionError(f"{name} is not supported (got {json.dumps(value)[:60]})")
    return found


def _guided(name: str, kind: str, value: Any) -> GrammarSpec:
    try:
        if kind == "json":
            if not isinstance(value, (dict, str)):
                raise InvalidOptionError(f"must be a JSON schema (an object or its JSON text), "
                                         f"got {json.dumps(value)[:60]}")
            return GrammarSpec("json_schema", value)
        if kind == "choice":
            if not (isinstance(value, list) and value
                    and all(isinstance(c, str) and c for c in value)):
                raise InvalidOptionError(f"must be a non-empty list of non-empty strings, "
                                         f"got {json.dumps(value)[:60]}")
            return GrammarSpec("regex", "|".join(map(_regex_literal, value)))
        if kind == "grammar" and isinstance(value, str) and "::=" in value:
            raise InvalidOptionError("tandem takes grammars in llguidance's Lark syntax (rules "
                                     "as `start: ...`), not GBNF/EBNF (`::=`)")
        return GrammarSpec("lark" if kind == "grammar" else "regex", value)
    except InvalidOptionError as exc:
        raise InvalidOptionError(f"{name}: {exc}") from None


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
