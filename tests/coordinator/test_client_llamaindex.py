"""LlamaIndex's Ollama integrations (llama-index-llms-ollama, llama-index-embeddings-ollama)
against a real tandem cluster on the default model, as its users call them: `chat`,
`stream_chat`, `achat`, `chat_with_tools` / `predict_and_call` with a FunctionTool, structured
output, and OllamaEmbedding. Greedy and short; answers compared with the `ollama` client's."""

from __future__ import annotations

import asyncio

import ollama
import pytest
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.embeddings.ollama import OllamaEmbedding
from llama_index.llms.ollama import Ollama
from pydantic import BaseModel

from tests.helpers.cluster import running_cluster

MODEL = "smollm2"
HELLO = "Say hello."


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny in {city}"


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def url(default_gguf, tmp_path_factory):
    with running_cluster(default_gguf, tmp_path_factory.mktemp("llamaindex") / "logs",
                         model=MODEL, coordinator_args=("--heartbeat-misses", "30")) as cluster:
        yield cluster.url


@pytest.fixture(autouse=True)
def no_client_key(monkeypatch):
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)


def llm(url: str, num_predict: int = 12) -> Ollama:
    # context_window given, so LlamaIndex does not ask /api/show for it on each call.
    return Ollama(model=MODEL, base_url=url, request_timeout=120, temperature=0,
                  context_window=2048, additional_kwargs={"num_predict": num_predict})


def test_chat_stream_chat_and_achat_match_the_ollama_client(url):
    messages = [ChatMessage(role="user", content=HELLO)]
    done = llm(url).chat(messages)
    streamed = "".join(c.delta or "" for c in llm(url).stream_chat(messages))
    again = asyncio.run(llm(url).achat(messages))
    direct = ollama.Client(host=url, timeout=120).chat(
        model=MODEL, messages=[{"role": "user", "content": HELLO}],
        options={"temperature": 0, "num_predict": 12})
    assert done.message.content and done.message.content == direct.message.content
    assert streamed == again.message.content == done.message.content
    assert done.raw["eval_count"] == 12


def test_tools_are_answered_and_predict_and_call_returns_the_models_answer(url):
    """The issue's failure was a 400 (no tools in the default model's template). The 135M
    model answers in text rather than calling (Ollama's API has no tool_choice to force it,
    and LlamaIndex's Ollama sends none), so predict_and_call is asked not to insist."""
    tool = FunctionTool.from_defaults(fn=get_weather)
    model = llm(url, num_predict=32)
    asked = model.chat_with_tools([tool], user_msg="What is the weather in Paris?")
    calls = model.get_tool_calls_from_response(asked, error_on_no_tool_call=False)
    assert calls or (asked.message.content or "").strip(), asked
    assert all(c.tool_name == "get_weather" for c in calls)
    answer = model.predict_and_call([tool], user_msg="What is the weather in Paris?",
                                    error_on_no_tool_call=False)
    assert answer.response.strip()
    assert all(s.tool_name == "get_weather" and s.raw_output.startswith("Sunny in")
               for s in answer.sources)


def test_structured_output_is_the_schemas(url):
    structured = llm(url, num_predict=64).as_structured_llm(City)
    reply = structured.chat([ChatMessage(
        role="user", content="Paris is a city in France. Give the city and its country.")])
    assert isinstance(reply.raw, City) and reply.raw.name and reply.raw.country


def test_ollama_embedding_equals_the_ollama_clients(url):
    embed = OllamaEmbedding(model_name=MODEL, base_url=url)
    text = embed.get_text_embedding("hello world")
    batch = embed.get_text_embedding_batch(["hello world", "bonjour"])
    query = asyncio.run(embed.aget_query_embedding("hello world"))
    direct = ollama.Client(host=url, timeout=120).embed(model=MODEL, input=["hello world", "bonjour"])
    for got, want in ((text, direct.embeddings[0]), (batch[1], direct.embeddings[1]),
                      (query, direct.embeddings[0])):
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-6
