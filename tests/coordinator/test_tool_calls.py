"""Tool calls on the coordinator (coordinator/tool_calls.py): template support, the parser
whole and streamed at every split, forced tool_choice grammars, and the API shapes."""

from __future__ import annotations

import json

import pytest

from coordinator.structured_output import ollama_format, openai_response_format
from coordinator.tool_calls import (
    BARE_JSON, HERMES, MISTRAL, ToolCallParser, ToolChoice, call_format, forced_grammar,
    ollama_tool_calls, openai_tool_calls, parse_tool_choice, require_tool_support, supports_tools,
)
from common.errors import InvalidOptionError
from common.sampling_params import GrammarSpec
from reliability.model_factory import CHATML_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def parse(fmt, text: str, step: int, choice: ToolChoice = ToolChoice("auto")):
    parser = ToolCallParser(fmt, TOOLS, choice)
    content, calls = "", []
    for i in range(0, len(text), step):
        piece, found = parser.push(text[i:i + step])
        content += piece
        calls += found
    piece, found = parser.finish()
    return content + piece, [(c.name, c.arguments) for c in calls + found]


HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
               '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_hermes_calls_are_found_at_every_split(step):
    content, calls = parse(HERMES, HERMES_TEXT, step)
    assert content == "Let me check.\n\n"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, "a < b, <tool is not a call", "a < b, <tool is not a call", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not one of ours
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # unclosed
    (HERMES, '  {"name": "get_time", "arguments": "{}"}', "", [("get_time", {})]),  # bare JSON
    (HERMES, '{"answer": 42}', '{"answer": 42}', []),
    (BARE_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    (BARE_JSON, "Hello there", "Hello there", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
    (MISTRAL, "[1, 2]", "[1, 2]", []),
])
def test_parser_cases(fmt, text, content, calls):
    for step in (1, 3, len(text)):
        assert parse(fmt, text, step) == (content, calls)


def test_forced_tool_choice_grammars_and_their_output():
    named = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert forced_grammar(TOOLS, named) == GrammarSpec("json_schema", WEATHER["function"]["parameters"])
    assert parse(HERMES, '{"city": "Oslo"}', 2, named) == ("", [("get_weather", {"city": "Oslo"})])
    required = parse_tool_choice("required", TOOLS)
    schema = forced_grammar(TOOLS, required).schema
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert "maxItems" not in schema
    assert forced_grammar(TOOLS, required, parallel=False).schema["maxItems"] == 1
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]'
    assert parse(HERMES, text, 4, required)[1] == [("get_time", {}), ("get_weather", {"city": "X"})]
    assert parse(HERMES, '{"city": "Os', 4, named) == ('{"city": "Os', [])  # cut off: content
    assert forced_grammar(TOOLS, parse_tool_choice("auto", TOOLS)) is None
    for value, message in [("always", "tool_choice must be"), ("required", "needs tools"),
                           ({"type": "function", "function": {"name": "nope"}}, "not among")]:
        with pytest.raises(InvalidOptionError, match=message):
            parse_tool_choice(value, TOOLS if message == "not among" or value == "always" else None)


def test_template_support_and_formats():
    assert not supports_tools(CHATML_TEMPLATE) and not supports_tools(None)
    assert not supports_tools("{{ 'tools are nice' }}")  # the word is no variable
    assert supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    with pytest.raises(InvalidOptionError, match="tiny does not support tools"):
        require_tool_support(TOOLS, CHATML_TEMPLATE, "tiny")
    require_tool_support(None, CHATML_TEMPLATE, "tiny")
    assert call_format("... <tool_call> ...") is HERMES
    assert call_format("... [TOOL_CALLS] ...") is MISTRAL
    assert call_format("{{ tools }}") is BARE_JSON


def test_response_shapes_and_formats():
    _, calls = ToolCallParser(HERMES, TOOLS).split(HERMES_TEXT)
    assert ollama_tool_calls(calls)[1] == {"function": {"index": 1, "name": "get_time", "arguments": {}}}
    first = openai_tool_calls(calls)[0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    assert openai_tool_calls(calls, first_index=3)[1]["index"] == 4
    assert ollama_format("json") == GrammarSpec("json") and ollama_format("") is None
    assert ollama_format({"type": "object"}) == GrammarSpec("json_schema", {"type": "object"})
    assert openai_response_format({"type": "text"}) is None
    assert openai_response_format({"type": "json_object"}) == GrammarSpec("json")
    assert openai_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer"}}}) == GrammarSpec("json_schema", {"type": "integer"})
    for bad in ("yaml", {"type": "xml"}, {"type": "json_schema"}):
        with pytest.raises(InvalidOptionError):
            (ollama_format if isinstance(bad, str) else openai_response_format)(bad)


def test_a_tool_list_past_the_limit_is_refused():
    from common.errors import InvalidOptionError
    from coordinator.tool_calls import MAX_TOOLS, check_tool_list

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    check_tool_list([tool] * MAX_TOOLS)
    with pytest.raises(InvalidOptionError, match=f"at most {MAX_TOOLS} tools"):
        check_tool_list([tool] * (MAX_TOOLS + 1))
