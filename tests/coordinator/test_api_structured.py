"""Structured output and tool calls through the real `ollama` and `openai` clients.

- The coordinator alone (fake workers): the 400s (a schema that does not compile, tools for a
  template without them), /api/show's capabilities, `format` reaching the workers as a grammar.
- A real cluster (prefill + decode processes, every prompt prefilled remotely, so the decode
  worker's grammar starts from a first token sampled elsewhere) on a tiny random Qwen2 model
  with a Qwen2.5-style tools template: its free output is noise, yet every answer under a
  schema validates, and a tool call round trip works in both clients, streamed and not.
- The default model (SmolLM2) on a real cluster: `ollama.chat(format=Model.model_json_schema())`
  and openai's `chat.completions.parse(response_format=Model)`, streamed and not.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import ollama
import openai
import pydantic
import pytest

from coordinator.model import load_served_model
from tests.helpers.cluster import running_cluster
from tests.helpers.coordinator_fakes import (
    Script, coordinator_harness, make_tiny_model_dir, openai_refusal, run,
)
from reliability.model_factory import make_tiny_hf_model

WORKER_ARGS = ("--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32")
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]

# Qwen2.5's chat template (its tools part): tools in the system turn, calls as <tool_call>.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


class Person(pydantic.BaseModel):
    # Bounded strings: a random model's free string would run to the token limit.
    name: str = pydantic.Field(pattern=r"^[a-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    member: bool
    color: Literal["red", "green", "blue"]


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(pattern=r"^[A-Z][a-z]{1,8}$")
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "GetWeather", "description": "The weather in a city.",
    "parameters": GetWeather.model_json_schema()}}
# Ollama has no tool_choice: a `format` of the call's own shape forces one.
WEATHER_CALL = {"type": "object", "properties": {
    "name": {"const": "GetWeather"}, "arguments": GetWeather.model_json_schema()},
    "required": ["name", "arguments"]}
SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 11, "num_predict": 400}


@pytest.fixture(autouse=True)
def no_client_key(monkeypatch):
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)


# ---- the coordinator alone ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chatml_model(tmp_path_factory):
    """A tiny model whose template (ChatML, as SmolLM2's) does not read `tools`."""
    return load_served_model(make_tiny_model_dir(tmp_path_factory.mktemp("chatml")), "tiny")


UNSATISFIABLE = "Unsatisfiable schema: minimum (5) is greater than maximum (1)"  # llguidance's


def test_refusals_and_capabilities_without_workers(chatml_model):
    bad_schema = {"type": "integer", "minimum": 5, "maximum": 1}

    async def scenario():
        async with coordinator_harness(chatml_model, prefill_threshold=10_000) as h:
            client = ollama.AsyncClient(host=h.url)
            oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
            errors = []
            for call in (
                client.chat(model="tiny", messages=MESSAGES, tools=[WEATHER_TOOL]),
                client.chat(model="tiny", messages=MESSAGES, format=bad_schema),
            ):
                with pytest.raises(ollama.ResponseError) as info:
                    await call
                errors.append((info.value.status_code, info.value.error))
            async with httpx.AsyncClient() as raw:  # the client itself refuses this format
                r = await raw.post(h.url + "/api/generate",
                                   json={"model": "tiny", "prompt": "x", "format": "yaml"})
                errors.append((r.status_code, r.json()["error"]))
            for kwargs in ({"tools": [WEATHER_TOOL]},
                           {"response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": bad_schema}}},
                           {"tools": [WEATHER_TOOL], "tool_choice": "required"}):
                with pytest.raises(openai.BadRequestError) as info:
                    await oai.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
                errors.append((info.value.status_code, info.value.body["message"]))
            show = await client.show("tiny")
            await oai.close()
            return errors, show

    errors, show = run(scenario())
    assert errors == [
        (400, "tiny does not support tools"),
        (400, "the JSON schema does not compile: " + UNSATISFIABLE),
        (400, 'format must be "json" or a JSON schema object, got "yaml"'),
        (400, "tiny does not support tools"),
        (400, "the JSON schema does not compile: " + UNSATISFIABLE),
        (400, "tiny does not support tools"),
    ]
    assert show.capabilities == ["completion"]


def test_format_and_response_format_reach_the_worker_as_a_grammar(chatml_model):
    answer = '{"name": "ann", "age": 3, "member": true, "color": "red"}'  # what a grammar allows
    tokens = chatml_model.tokenizer.encode(answer, add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(chatml_model, prefill_threshold=10_000) as h:
            worker = await h.add_worker("d1", "colocated", Script(tokens=tokens))
            client = ollama.AsyncClient(host=h.url)
            await client.chat(model="tiny", messages=MESSAGES, format="json")
            await client.generate(model="tiny", prompt="x", format=Person.model_json_schema())
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x") as oai:
                await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                  response_format={"type": "json_object"})
                await oai.chat.completions.parse(model="tiny", messages=MESSAGES,
                                                 response_format=Person)
            return worker

    worker = run(scenario())
    kinds = [(r.sampling.grammar_kind, json.loads(r.sampling.grammar or "null"))
             for r in worker.requests]
    assert kinds[0] == ("json", None) and kinds[2] == ("json", None)
    assert kinds[1] == ("json_schema", Person.model_json_schema())
    assert kinds[3][0] == "json_schema" and kinds[3][1]["additionalProperties"] is False



GUIDED = [  # (extra_body, the grammar the worker gets)
    ({"guided_json": {"type": "object"}}, ("json_schema", '{"type":"object"}')),
    ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no (a.k.a. nope)"]}, ("regex", r"yes|no \(a\.k\.a\. nope\)")),
    ({"guided_grammar": 'start: "x"+'}, ("lark", 'start: "x"+')),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, ("json_schema", '{"type":"integer"}')),
    ({"structured_outputs": {"regex": "a|b", "disable_fallback": True}}, ("regex", "a|b")),
    ({"structured_outputs": {"choice": ["p", "q"]}}, ("regex", "p|q")),
    ({"structured_outputs": {"grammar": 'start: "y"'}}, ("lark", 'start: "y"')),
    ({"structured_outputs": {"json_object": True}}, ("json", "")),
]


def test_vllm_guided_fields_reach_the_worker_as_a_grammar(chatml_model):
    tokens = chatml_model.tokenizer.encode("yes", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(chatml_model, prefill_threshold=10_000) as h:
            worker = await h.add_worker("d1", "colocated", Script(tokens=tokens))
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x") as oai:
                for extra, _ in GUIDED:
                    await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                      extra_body=extra)
                await oai.completions.create(model="tiny", prompt="x",
                                             extra_body={"guided_regex": "[a-z]"})
            return worker

    worker = run(scenario())
    got = [(r.sampling.grammar_kind, r.sampling.grammar) for r in worker.requests]
    assert got == [want for _, want in GUIDED] + [("regex", "[a-z]")]


@pytest.mark.parametrize("extra,message", [
    ({"guided_regex": "a", "response_format": {"type": "json_object"}},
     "response_format and guided_regex cannot be combined"),
    ({"guided_json": {}, "guided_choice": ["a"]}, "guided_json and guided_choice cannot be combined"),
    ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}},
     "guided_regex and structured_outputs.choice cannot be combined"),
    ({"structured_outputs": {"json": {}, "regex": "a"}},
     "structured_outputs.json and structured_outputs.regex cannot be combined"),
    ({"guided_choice": [], }, "guided_choice: must be a non-empty list of non-empty strings"),
    ({"guided_json": 5}, "guided_json: must be a JSON schema"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag is not supported"),
    ({"structured_outputs": "json"}, "structured_outputs must be an object"),
    ({"guided_grammar": 'root ::= "x"'}, "guided_grammar: tandem takes grammars in llguidance's Lark"),
    ({"guided_grammar": 'start: ('}, "the Lark grammar does not compile"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos and guided_regex cannot be combined"),
    ({"guided_regex": "a", "tools": [WEATHER_TOOL], "tool_choice": "required"},
     "guided_regex and a forced tool_choice cannot be combined"),
])
def test_conflicting_or_malformed_guided_fields_are_a_400_naming_them(chatml_model, extra, message):
    error = openai_refusal(chatml_model, extra)
    assert error.status_code == 400 and message in error.body["message"], error.body

# ---- a real cluster on a tiny random Qwen2 with a tools template -------------------------------

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-tools")
    # The tools system turn alone is ~600 of this byte-level vocabulary's tokens.
    model_dir = make_tiny_hf_model(root / "model", "qwen2", max_position=2048)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = QWEN_TOOLS_TEMPLATE
    config_file.write_text(json.dumps(config))
    with running_cluster(model_dir, root / "logs", model="qwen", worker_args=WORKER_ARGS,
                         prefill_threshold=0) as cluster:
        yield cluster


def test_random_model_answers_validate_under_a_schema_through_both_clients(qwen):
    client = ollama.Client(host=qwen.url, timeout=120)
    schema = Person.model_json_schema()
    for seed in (1, 2):
        r = client.chat(model="qwen", messages=MESSAGES, format=schema, options={**SAMPLED, "seed": seed})
        assert r.done_reason == "stop"
        Person.model_validate_json(r.message.content)
    parts = list(client.chat(model="qwen", messages=MESSAGES, format=schema, options=SAMPLED,
                             stream=True))
    Person.model_validate_json("".join(p.message.content for p in parts))
    gen = client.generate(model="qwen", prompt="A person:", format=schema, options=SAMPLED)
    Person.model_validate_json(gen.response)

    oai = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", timeout=120)
    done = oai.chat.completions.parse(model="qwen", messages=MESSAGES, response_format=Person,
                                      seed=3, max_tokens=400)
    assert isinstance(done.choices[0].message.parsed, Person)
    assert done.choices[0].finish_reason == "stop"
    with oai.chat.completions.stream(model="qwen", messages=MESSAGES, response_format=Person,
                                     seed=4, max_tokens=400) as stream:
        for _ in stream:
            pass
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, Person)



def test_random_model_answers_obey_vllms_guided_fields(qwen):
    """Every prompt is prefilled remotely here: the first token, sampled by the prefill
    worker, obeys the grammar too."""
    oai = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", timeout=120)
    choices = ["red apple", "green (pear)", "blue.berry"]
    for seed in (1, 2, 3):
        chat = oai.chat.completions.create(model="qwen", messages=MESSAGES, seed=seed,
                                           max_tokens=50, extra_body={"guided_choice": choices})
        assert chat.choices[0].message.content in choices
        text = oai.completions.create(model="qwen", prompt="Code:", seed=seed, max_tokens=50,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", text.choices[0].text), text.choices[0].text
    new_style = oai.chat.completions.create(
        model="qwen", messages=MESSAGES, seed=5, max_tokens=400,
        extra_body={"structured_outputs": {"json": Person.model_json_schema()}})
    Person.model_validate_json(new_style.choices[0].message.content)
    old_style = oai.chat.completions.create(
        model="qwen", messages=MESSAGES, seed=6, max_tokens=50,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert old_style.choices[0].message.content in ("yes", "no")

def test_tool_call_round_trip_through_the_ollama_client(qwen):
    client = ollama.Client(host=qwen.url, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(model="qwen", messages=ask, tools=[WEATHER_TOOL], format=WEATHER_CALL,
                    options=SAMPLED)
    (call,) = r.message.tool_calls
    assert call.function.name == "GetWeather" and r.message.content == ""
    GetWeather.model_validate(call.function.arguments)
    parts = list(client.chat(model="qwen", messages=ask, tools=[WEATHER_TOOL],
                             format=WEATHER_CALL, options=SAMPLED, stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.arguments for c in streamed] == [call.function.arguments]  # same seed
    # The call and its result go back; the model answers (any text: it is random).
    follow = client.chat(model="qwen", tools=[WEATHER_TOOL], options={**SAMPLED, "num_predict": 8},
                         messages=[*ask, r.message,
                                   {"role": "tool", "content": '{"celsius": 18}',
                                    "tool_name": "GetWeather"}])
    assert follow.done and not follow.message.tool_calls


def test_tool_call_round_trip_through_the_openai_client(qwen):
    oai = openai.OpenAI(base_url=qwen.url + "/v1", api_key="x", timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [openai.pydantic_function_tool(GetWeather)]
    done = oai.chat.completions.parse(model="qwen", messages=ask, tools=tools,
                                      tool_choice="required", parallel_tool_calls=False,
                                      seed=5, max_tokens=400)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls  # parallel_tool_calls false: one
    assert call.id.startswith("call_") and call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)

    named = {"type": "function", "function": {"name": "GetWeather"}}
    chunks = list(oai.chat.completions.create(model="qwen", messages=ask, tools=tools,
                                              tool_choice=named, seed=6, max_tokens=400,
                                              stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0] and deltas[0].function.name == "GetWeather"
    GetWeather.model_validate_json(deltas[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    follow = oai.chat.completions.create(model="qwen", tools=tools, seed=7, max_tokens=8, messages=[
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    show = httpx.post(qwen.url + "/api/show", json={"model": "qwen"}, timeout=30).json()
    assert show["capabilities"] == ["completion", "tools"]


# ---- the default model ----------------------------------------------------------------------------

class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


@pytest.mark.model
def test_default_model_structured_output_through_both_clients(default_gguf, tmp_path):
    ask = [{"role": "user", "content": "Give me the name, country and population of Paris."}]
    with running_cluster(default_gguf, tmp_path / "logs", model="smollm2",
                         prefill_threshold=0) as cluster:
        client = ollama.Client(host=cluster.url, timeout=300)
        options = {"temperature": 0, "num_predict": 128}
        whole = client.chat(model="smollm2", messages=ask, format=City.model_json_schema(),
                            options=options)
        City.model_validate_json(whole.message.content)
        parts = list(client.chat(model="smollm2", messages=ask, format=City.model_json_schema(),
                                 options=options, stream=True))
        assert "".join(p.message.content for p in parts) == whole.message.content

        oai = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=300)
        done = oai.chat.completions.parse(model="smollm2", messages=ask, response_format=City,
                                          temperature=0, max_tokens=128)
        assert isinstance(done.choices[0].message.parsed, City)
        with oai.chat.completions.stream(model="smollm2", messages=ask, response_format=City,
                                         temperature=0, max_tokens=128) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion().choices[0].message
        assert isinstance(final.parsed, City) and final.parsed == done.choices[0].message.parsed
