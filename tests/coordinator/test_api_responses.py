"""/v1/responses with the real `openai` client (`responses.create`, `responses.stream`,
`responses.parse`) against the real coordinator on fake workers: text input and instructions,
whole and streamed, the event order, usage, incomplete at max_output_tokens, function tools
(calls as function_call items, whole and streamed; results sent back as input items, rendered
as /v1/chat/completions renders them), forced tool_choice and text.format as the worker's
grammar, and the 400s naming what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

import common
from coordinator.model import load_served_model
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, harness_on_thread, load_model, make_tiny_model_dir,
)

TOKENS = [200, 201, 202, 203, 204]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def live(model):
    async def setup(h):
        prefill = await h.add_worker("p1", "prefill", Script(tokens=TOKENS))
        decode = await h.add_worker("d1", "decode", Script(tokens=TOKENS, finish_reason="stop"))
        return h.url, decode, prefill

    with harness_on_thread(model, setup, prefill_threshold=10_000) as value:
        yield value


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="x", timeout=DEADLINE_S,
                         max_retries=0)


def _prompt_of_last_request(decode) -> list[int]:
    return list(decode.requests[-1].prompt_token_ids)


def test_create_answers_as_chat_completions_does(live, oai, model):
    url, decode, _ = live
    chat = oai.chat.completions.create(model="tiny", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    chat_prompt = _prompt_of_last_request(decode)
    r = oai.responses.create(model="tiny", input="Hi there", instructions="Be brief.")
    assert _prompt_of_last_request(decode) == chat_prompt  # instructions: the system message
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text"
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == len(TOKENS)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_input_as_messages_with_text_parts(live, oai):
    _, decode, _ = live
    oai.responses.create(model="tiny", input="Hi there", instructions="Be brief.")
    plain = _prompt_of_last_request(decode)
    oai.responses.create(model="tiny", input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text",
                                                               "text": "there"}]}])
    assert _prompt_of_last_request(decode) == plain


def test_stream_sends_the_events_in_order_and_the_helper_assembles_them(oai):
    whole = oai.responses.create(model="tiny", input="Hi there")
    with oai.responses.stream(model="tiny", input="Hi there") as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.status == "completed" and final.usage.output_tokens == len(TOKENS)
    # create(stream=True): the raw events, numbered in order.
    numbers = [e.sequence_number for e in oai.responses.create(model="tiny", input="Hi there",
                                                              stream=True)]
    assert numbers == list(range(len(numbers)))


def test_an_answer_cut_at_its_length_is_incomplete(model):
    # The fake worker ends at its script's length, as a real one at max_output_tokens.
    async def setup(h):
        await h.add_worker("d1", "decode", Script(tokens=TOKENS, finish_reason="length"))
        return h.url

    with harness_on_thread(model, setup, prefill_threshold=10_000) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S,
                               max_retries=0)
        r = client.responses.create(model="tiny", input="Hi there", max_output_tokens=5)
        events = list(client.responses.create(model="tiny", input="Hi there",
                                              max_output_tokens=5, stream=True))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 5 and r.usage.output_tokens == len(TOKENS)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.output[0].content[0].text == r.output_text


@pytest.mark.parametrize("body, message", [
    # the tiny model's own template (ChatML) renders no tools: Ollama's 400
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]},
     "tiny does not support tools"),
    ({"tools": [{"type": "web_search"}]},
     'tools[0]: tools of type "web_search" are not supported (function tools only)'),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name is required"),
    ({"tool_choice": "always"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "which is not among the tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}},
     "text.format and a forced tool_choice cannot be combined"),
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"text": {"format": {"type": "yaml"}}}, 'text.format.type must be "text", "json_object"'),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema must be a JSON schema object"),
    ({"reasoning": {"effort": "low"}}, "reasoning is not supported"),
    ({"input": [{"type": "input_file", "file_id": "f"}]},
     'input[0]: input items of type "input_file" are not supported'),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments must be a JSON object"),
    ({"input": [{"type": "function_call_output", "output": "x"}]},
     "input[0].call_id must be a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]: only text parts are supported"),
    ({"input": ""}, "input must be a non-empty string"),
    ({"max_output_tokens": 0}, "max_output_tokens must be an integer between 1"),
    ({"temperature": 3}, "temperature must be a number between 0 and 2"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role must be one of"),
])
def test_refusals_are_400s_naming_the_field(live, body, message):
    r = httpx.post(live[0] + "/v1/responses", timeout=DEADLINE_S,
                   json={"model": "tiny", "input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="Hi")


# ---- tools and structured output -------------------------------------------------------------

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                       "parameters")}}
CALL_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>')


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """The tiny model with the tools template tandem ships for SmolLM2 (Hermes-style calls)."""
    template = Path(common.__file__).parent / "chat_templates" / "smollm2_tools.jinja"
    return load_served_model(make_tiny_model_dir(tmp_path_factory.mktemp("tools"), 4096), "tiny",
                             template_file=template)


def _serving(model, text: str):
    """A coordinator whose decode worker answers every request with `text`."""
    tokens = model.tokenizer.encode(text, add_special_tokens=False)

    async def setup(h):
        worker = await h.add_worker("d1", "colocated", Script(tokens=tokens))
        return h.url, worker

    return harness_on_thread(model, setup, prefill_threshold=10_000)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S, max_retries=0)


def test_function_calls_come_back_as_items_whole_and_streamed(tools_model):
    with _serving(tools_model, CALL_TEXT) as (url, worker):
        oai = _client(url)
        r = oai.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL])
        prompt = tools_model.tokenizer.decode(list(worker.requests[-1].prompt_token_ids))
        with oai.responses.stream(model="tiny", input="Weather in Paris?", tools=[TOOL]) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
    assert '"get_weather"' in prompt and "<tools>" in prompt  # the template rendered the tool
    for got in (r, final):
        message, call = got.output
        assert message.type == "message" and message.content[0].text == "Let me check."
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.status == "completed" and got.status == "completed"
        assert [t.name for t in got.tools] == ["get_weather"] and got.tool_choice == "auto"
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]


def test_a_tool_result_goes_back_as_input_items_rendered_as_chat_renders_it(tools_model):
    arguments = '{"city": "Paris"}'
    with _serving(tools_model, "It is 22 C and sunny in Paris.") as (url, worker):
        oai = _client(url)
        r = oai.responses.create(model="tiny", tools=[TOOL], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "22 C, sunny"}])
        responses_prompt = list(worker.requests[-1].prompt_token_ids)
        oai.chat.completions.create(model="tiny", tools=[CHAT_TOOL], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}])
        chat_prompt = list(worker.requests[-1].prompt_token_ids)
    assert responses_prompt == chat_prompt
    assert "22 C, sunny" in tools_model.tokenizer.decode(responses_prompt)
    assert r.output_text == "It is 22 C and sunny in Paris." and len(r.output) == 1


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_forced_tool_choice_and_text_format_reach_the_worker_as_grammars(tools_model):
    with _serving(tools_model, '{"name": "ann", "age": 3}') as (url, worker):
        oai = _client(url)
        named = oai.responses.create(model="tiny", input="Weather?", tools=[TOOL],
                                     tool_choice={"type": "function", "name": "get_weather"})
        one = oai.responses.create(model="tiny", input="Weather?", tools=[TOOL],
                                   tool_choice="required", parallel_tool_calls=False)
        parsed = oai.responses.parse(model="tiny", input="Who?", text_format=Person)
        as_json = oai.responses.create(model="tiny", input="Who?",
                                       text={"format": {"type": "json_object"}})
        grammars = [(r.sampling.grammar_kind, json.loads(r.sampling.grammar or "null"))
                    for r in worker.requests]
    assert grammars[0] == ("json_schema", TOOL["parameters"])
    assert grammars[1][0] == "json_schema" and grammars[1][1]["maxItems"] == 1
    assert grammars[2][0] == "json_schema" and grammars[2][1]["properties"].keys() == {"name", "age"}
    assert grammars[3] == ("json", None)
    # The named call's output is its arguments (the fake worker's text stands in for them).
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"name": "ann", "age": 3}
    assert named.tool_choice.name == "get_weather" and one.parallel_tool_calls is False
    assert parsed.output_parsed == Person(name="ann", age=3)
    assert parsed.text.format.type == "json_schema"
    assert as_json.text.format.type == "json_object" and json.loads(as_json.output_text)["age"] == 3
