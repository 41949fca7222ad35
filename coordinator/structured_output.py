"""The APIs' structured-output fields -> the GrammarSpec that the workers' sampler enforces
(engine/grammar.py).

    Ollama  `format`: "json"                        -> GrammarSpec("json"): any JSON object
            `format`: {JSON schema}                 -> GrammarSpec("json_schema", schema)
    OpenAI  `response_format`: {"type": "text"}     -> none
            {"type": "json_object"}                 -> GrammarSpec("json")
            {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                    -> GrammarSpec("json_schema", schema)
                                                       (no "schema": any JSON object)

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
