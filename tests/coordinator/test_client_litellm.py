"""LiteLLM against a real tandem cluster (coordinator, prefill and decode processes on the
default model), called as its users call it: `ollama_chat/` through the Ollama API and
`openai/` through /v1, plain, streamed, with `tools=` (the default model's shipped tools
template), a tool result sent back, and embeddings through both. Greedy and short, so each
answer is compared with the same request made by the `ollama` client directly."""

from __future__ import annotations

import json
import math
import os

# LiteLLM fetches its model-price map from the network at import unless told to use the copy
# it ships; offline (as here) that fetch would only cost a timeout.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import ollama  # noqa: E402
import pytest  # noqa: E402

from tests.helpers.cluster import running_cluster  # noqa: E402

MODEL = "smollm2"
GREEDY = {"temperature": 0, "max_tokens": 12}
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A finished call and its result, as LiteLLM's docs show the second turn of a tool loop.
ANSWERED = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "clear"}'},
]


@pytest.fixture(scope="module")
def url(default_gguf, tmp_path_factory):
    # Liveness is not under test: a loaded 2-core host can starve heartbeats for seconds.
    with running_cluster(default_gguf, tmp_path_factory.mktemp("litellm") / "logs", model=MODEL,
                         coordinator_args=("--heartbeat-misses", "30")) as cluster:
        yield cluster.url


@pytest.fixture(autouse=True)
def no_client_key(monkeypatch):
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)


def ollama_api(url: str) -> dict:
    return {"model": f"ollama_chat/{MODEL}", "api_base": url}


def openai_api(url: str) -> dict:
    return {"model": f"openai/{MODEL}", "api_base": url + "/v1", "api_key": "unused"}


def test_ollama_chat_plain_and_streamed_match_the_ollama_client(url):
    done = litellm.completion(**ollama_api(url), messages=HELLO, **GREEDY)
    parts = list(litellm.completion(**ollama_api(url), messages=HELLO, stream=True, **GREEDY))
    direct = ollama.Client(host=url, timeout=120).chat(
        model=MODEL, messages=HELLO, options={"temperature": 0, "num_predict": 12})
    text = done.choices[0].message.content
    assert text and text == direct.message.content  # max_tokens became num_predict
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == direct.prompt_eval_count
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text


def test_openai_route_plain_and_streamed_give_the_same_text(url):
    done = litellm.completion(**openai_api(url), messages=HELLO, **GREEDY)
    parts = list(litellm.completion(**openai_api(url), messages=HELLO, stream=True, **GREEDY))
    native = litellm.completion(**ollama_api(url), messages=HELLO, **GREEDY)
    assert done.choices[0].message.content == native.choices[0].message.content
    assert "".join(p.choices[0].delta.content or "" for p in parts) == done.choices[0].message.content
    assert done.usage.completion_tokens == 12


def test_tools_through_ollama_chat_are_answered_and_a_result_goes_back(url):
    """The issue's failure was a 400 (no tools in the default model's template). The 135M
    model answers this in text rather than a call; a call, if it wrote one, must be parsed."""
    asked = litellm.completion(**ollama_api(url), messages=ASK, tools=[WEATHER],
                               temperature=0, max_tokens=32)
    message = asked.choices[0].message
    assert message.tool_calls or (message.content or "").strip(), asked
    assert all(c.function.name == "get_weather" for c in message.tool_calls or [])
    streamed = list(litellm.completion(**ollama_api(url), messages=ASK, tools=[WEATHER],
                                       temperature=0, max_tokens=32, stream=True))
    # Answered, not compared with the plain answer: the first request on a fresh cluster and a
    # repeat of it (prefix-cache hit) can part ways after ~20 greedy tokens (see the README).
    assert "".join(p.choices[0].delta.content or "" for p in streamed).strip() or any(
        p.choices[0].delta.tool_calls for p in streamed)
    result = litellm.completion(**ollama_api(url), messages=ANSWERED, tools=[WEATHER],
                                temperature=0, max_tokens=24)
    assert (result.choices[0].message.content or "").strip(), result


def test_a_forced_tool_call_through_the_openai_route_is_parsed_and_its_result_answered(url):
    forced = litellm.completion(**openai_api(url), messages=ASK, tools=[WEATHER],
                                tool_choice="required", temperature=0, max_tokens=48)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, forced
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    answer = litellm.completion(**openai_api(url), messages=history, tools=[WEATHER],
                                temperature=0, max_tokens=24)
    assert (answer.choices[0].message.content or "").strip(), answer


def test_embeddings_through_both_routes_equal_the_ollama_clients(url):
    texts = ["hello world", "bonjour"]
    native = litellm.embedding(model=f"ollama/{MODEL}", api_base=url, input=texts)
    oai = litellm.embedding(**openai_api(url), input=texts)
    direct = ollama.Client(host=url, timeout=120).embed(model=MODEL, input=texts).embeddings
    # LiteLLM refuses `dimensions` for openai/ models unless allowed by name (its own rule).
    short = litellm.embedding(**openai_api(url), input=texts[:1], dimensions=64,
                              allowed_openai_params=["dimensions"])
    for got in (native, oai):
        vectors = [d["embedding"] for d in got.data]
        assert len(vectors) == 2 and len(vectors[0]) == len(direct[0])
        for v, d in zip(vectors, direct):
            assert max(abs(a - b) for a, b in zip(v, d)) < 1e-6
    assert native.usage.prompt_tokens > 0
    cut = short.data[0]["embedding"]
    assert len(cut) == 64 and math.isclose(math.fsum(x * x for x in cut), 1.0, rel_tol=1e-4)
