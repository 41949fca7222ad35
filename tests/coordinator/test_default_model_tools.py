"""The default model takes tools (issue 24): SmolLM2's own template reads no `tools`, so tandem
serves the tools template it ships for the family (common/chat_template_choice.py), and a chat
with tools through the real `ollama` and `openai` clients, as Open WebUI, LiteLLM and
LlamaIndex send them, is answered (a parsed call or text) instead of a 400. A template without
tools still refuses them when no override applies (--chat-template of such a file)."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

from coordinator.model import load_served_model
from tests.helpers.cluster import running_cluster
from tests.helpers.coordinator_fakes import coordinator_harness, run

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "The city"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(autouse=True)
def no_client_key(monkeypatch):
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)


@pytest.mark.model
def test_the_default_model_answers_chats_with_tools_through_both_clients(default_gguf, tmp_path):
    # Liveness is not under test: a shared 2-core host can starve a worker's heartbeats for
    # seconds while it compiles the forced call's grammar.
    with running_cluster(default_gguf, tmp_path / "logs", model="smollm2", colocated=True,
                         coordinator_args=("--heartbeat-misses", "30")) as cluster:
        client = ollama.Client(host=cluster.url, timeout=300)
        show = client.show("smollm2")
        options = {"temperature": 0, "num_predict": 64}
        answer = client.chat(model="smollm2", messages=ASK, tools=[WEATHER], options=options)
        streamed = list(client.chat(model="smollm2", messages=ASK, tools=[WEATHER],
                                    options=options, stream=True))
        oai = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=300, max_retries=0)
        done = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                           temperature=0, max_tokens=64)
        forced = oai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER],
                                             tool_choice="required", temperature=0,
                                             max_tokens=64)
    assert "tools" in show.capabilities and "<tools>" in show.template
    calls = answer.message.tool_calls or []
    assert calls or answer.message.content.strip(), answer
    assert all(c.function.name == "get_weather" for c in calls)
    streamed_calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert [c.function.name for c in streamed_calls] == [c.function.name for c in calls]
    assert "".join(p.message.content for p in streamed) == answer.message.content
    message = done.choices[0].message
    assert message.tool_calls or (message.content or "").strip(), done
    if message.tool_calls:
        assert done.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in message.tool_calls)
    # Forced: a call of the one tool whatever the model would have written.
    forced_calls = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and forced_calls
    assert forced_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(forced_calls[0].function.arguments), dict)


@pytest.mark.model
def test_a_chat_template_flag_without_tools_still_refuses_them(default_gguf, tmp_path):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
                     " + '<|im_end|>\\n' }}{% endfor %}{{ '<|im_start|>assistant\\n' }}")
    model = load_served_model(default_gguf, "smollm2", template_file=plain)

    async def scenario():
        async with coordinator_harness(model) as h:
            client = ollama.AsyncClient(host=h.url)
            with pytest.raises(ollama.ResponseError) as info:
                await client.chat(model="smollm2", messages=ASK, tools=[WEATHER])
            return info.value, await client.show("smollm2")

    error, show = run(scenario())
    assert (error.status_code, error.error) == (400, "smollm2 does not support tools")
    assert show.capabilities == ["completion"] and show.template == plain.read_text()
