"""The OpenAI HTTP API (real `openai` client) and the gRPC client API (coordinator.client,
health, reflection) of a running tandem."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.client import TandemClient
from tests.helpers.api_cluster import GREEDY, MODEL, api  # noqa: F401 (fixture)

MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def ollama_answer(api):
    import ollama

    return ollama.Client(host=api.url, timeout=60).chat(model=MODEL, messages=MESSAGES,
                                                        options=GREEDY)


def test_openai_chat_completions_streamed_and_not(oai, ollama_answer):
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                        max_tokens=12)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ollama_answer.message.content
    assert choice.finish_reason == ollama_answer.done_reason
    assert whole.usage.prompt_tokens == ollama_answer.prompt_eval_count
    assert whole.usage.completion_tokens == ollama_answer.eval_count
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                              max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == choice.finish_reason and not any(finals[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_completions_and_models(oai):
    whole = oai.completions.create(model=MODEL, prompt="rivers", temperature=0, max_tokens=8)
    assert whole.choices[0].text and whole.usage.completion_tokens <= 8
    streamed = list(oai.completions.create(model=MODEL, prompt="rivers", temperature=0,
                                           max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert [m.id for m in oai.models.list().data] == [f"{MODEL}:latest"]


def test_openai_errors_have_openai_shape(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="nope", messages=MESSAGES)
    assert "model 'nope' not found" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
    assert "n must be an integer between 1 and 16, got 17" in info.value.message
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)


def test_grpc_streaming_generate_chat_and_list(api, ollama_answer):
    with TandemClient(api.grpc_target, timeout_s=60) as client:
        assert client.health() == "SERVING"
        assert client.health("tandem.v1.Tandem") == "SERVING"
        responses = list(client.generate(MODEL, "Name three rivers.", options=GREEDY))
        *pieces, last = responses
        assert pieces and not any(r.done for r in pieces) and last.done
        assert "".join(r.response for r in pieces) == ollama_answer.message.content
        assert last.done_reason == ollama_answer.done_reason
        f = last.figures
        assert f.prompt_eval_count == ollama_answer.prompt_eval_count
        assert f.eval_count == ollama_answer.eval_count
        assert f.total_duration >= f.prompt_eval_duration > 0 and f.load_duration == 0
        assert len(last.context) == f.prompt_eval_count + f.eval_count
        assert client.chat_text(MODEL, MESSAGES, options=GREEDY) == ollama_answer.message.content
        (model,) = client.list_models()
        assert model.name == f"{MODEL}:latest" and model.context_length == 512


@pytest.mark.parametrize("kwargs, code, message", [
    ({"model": "nope", "prompt": "x"}, grpc.StatusCode.NOT_FOUND, "model 'nope' not found"),
    ({"model": MODEL, "prompt": "x", "options": {"num_ctx": 10**6}},
     grpc.StatusCode.INVALID_ARGUMENT, "num_ctx"),
    ({"model": MODEL, "prompt": "x", "options": {"top_p": 2.0}},
     grpc.StatusCode.INVALID_ARGUMENT, "option 'top_p'"),
])
def test_grpc_errors_are_status_codes(api, kwargs, code, message):
    with TandemClient(api.grpc_target, timeout_s=30) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(**kwargs))
    assert info.value.code() == code and message in info.value.details()


def test_grpc_cancel_frees_kv_blocks(api):
    # Inputs whose answer runs the full 400 tokens without a stop token (checked first), so the
    # request is certainly still running when the call is cancelled.
    messages = [{"role": "user", "content": "Name three rivers."}]
    options = {"temperature": 0.9, "seed": 5, "num_predict": 400, "stop": []}
    whole = httpx.post(api.url + "/api/chat", json={"model": MODEL, "messages": messages,
                                                   "options": options, "stream": False}, timeout=60).json()
    assert whole["done_reason"] == "length" and whole["eval_count"] == 400, whole
    before = api.cancelled_requests()
    with TandemClient(api.grpc_target, timeout_s=60) as client:
        stream = client.chat(MODEL, messages, options=options)
        first = next(stream)
        assert not first.done
        stream.close()  # leaves the iteration early: cancels the call
    assert api.wait_cancelled(before + 1) == before + 1
    workers = api.cluster.wait_pools_full(timeout_s=30)
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in workers), workers


def test_grpc_reflection_lists_the_services(api):
    with grpc.insecure_channel(api.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names
