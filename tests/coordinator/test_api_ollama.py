"""The Ollama HTTP API of a running tandem (real coordinator and worker processes), through the
real `ollama` Python client (sync and async) and raw HTTP for what a client cannot send."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import ollama
import pytest

from coordinator.client import TandemClient
from tests.helpers.api_cluster import GREEDY, MAX_BODY, MODEL, api  # noqa: F401 (fixture)

MESSAGES = [{"role": "user", "content": "Name three rivers."}]
FIGURES = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
           "eval_count", "eval_duration")


def check_figures(r) -> None:
    for name in FIGURES:
        value = getattr(r, name)
        assert isinstance(value, int) and value >= 0, (name, value)
    assert r.load_duration == 0
    assert r.prompt_eval_count > 0 and 0 < r.eval_count <= GREEDY["num_predict"]
    assert r.total_duration >= r.prompt_eval_duration > 0
    assert r.total_duration >= r.eval_duration
    assert r.done_reason in ("stop", "length")
    if r.done_reason == "length":
        assert r.eval_count == GREEDY["num_predict"]


def test_sync_client_chat_and_generate_streamed_and_not(api):
    client = ollama.Client(host=api.url, timeout=60)
    whole = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    check_figures(whole)
    assert whole.message.role == "assistant" and whole.message.content
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    check_figures(parts[-1])
    assert parts[-1].eval_count == whole.eval_count
    assert parts[-1].prompt_eval_count == whole.prompt_eval_count

    gen = client.generate(model=MODEL, prompt="Name three rivers.", options=GREEDY)
    check_figures(gen)
    assert gen.response == whole.message.content  # the same templated prompt
    assert len(gen.context) == gen.prompt_eval_count + gen.eval_count
    pieces = list(client.generate(model=MODEL, prompt="Name three rivers.", options=GREEDY,
                                  stream=True))
    assert "".join(p.response for p in pieces) == gen.response and pieces[-1].done
    assert pieces[-1].context == gen.context

    raw = client.generate(model=MODEL, prompt="rivers", raw=True, options=GREEDY)
    check_figures(raw)
    assert raw.context is None  # Ollama omits context in raw mode
    follow = client.generate(model=MODEL, prompt="And lakes?", context=gen.context,
                             options=GREEDY)
    assert follow.prompt_eval_count > len(gen.context)


def test_async_client_chat_and_generate(api):
    async def scenario():
        client = ollama.AsyncClient(host=api.url, timeout=60)
        whole = await client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
        parts = [p async for p in await client.chat(model=MODEL, messages=MESSAGES,
                                                     options=GREEDY, stream=True)]
        gen = await client.generate(model=MODEL, prompt="Name three rivers.", options=GREEDY)
        pieces = [p async for p in await client.generate(
            model=MODEL, prompt="Name three rivers.", options=GREEDY, stream=True)]
        return whole, parts, gen, pieces

    whole, parts, gen, pieces = asyncio.run(asyncio.wait_for(scenario(), 120))
    check_figures(whole)
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "".join(p.response for p in pieces) == gen.response == whole.message.content


def test_every_sampling_option_is_accepted(api):
    options = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "typical_p": 0.9,
               "repeat_penalty": 1.1, "repeat_last_n": 32, "presence_penalty": 0.2,
               "frequency_penalty": 0.1, "seed": 42, "num_predict": 8, "stop": ["\n\n\n"],
               "num_ctx": 256, "num_keep": 4, "num_batch": 64, "num_thread": 1}
    client = ollama.Client(host=api.url, timeout=60)
    a = client.chat(model=MODEL, messages=MESSAGES, options=options)
    b = client.chat(model=MODEL, messages=MESSAGES, options=options)
    assert a.message.content == b.message.content  # a fixed seed reproduces
    assert a.eval_count <= 8


def test_list_show_ps_version_and_root(api):
    client = ollama.Client(host=api.url, timeout=30)
    (entry,) = client.list().models
    assert entry.model == f"{MODEL}:latest" and entry.size > 0 and entry.details.family == "llama"
    assert entry.modified_at is not None
    shown = client.show(f"{MODEL}:latest")
    assert shown.modelinfo["general.architecture"] == "llama"
    assert "completion" in shown.capabilities and shown.template
    (running,) = client.ps().models
    assert running.model == f"{MODEL}:latest" and running.expires_at is not None
    assert httpx.get(api.url + "/api/version").json()["version"]
    assert httpx.get(api.url + "/").text == "Ollama is running"
    head = httpx.head(api.url + "/")
    assert head.status_code == 200 and head.text == ""


def post(api, path: str, content: bytes | str, timeout: float = 60) -> httpx.Response:
    return httpx.post(api.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def body(**fields) -> str:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "stream": False, **fields})


@pytest.mark.parametrize("content, status, message", [
    (b"{not json", 400, "invalid JSON"),
    (b"", 400, "missing request body"),
    (json.dumps({"messages": MESSAGES}), 400, "model is required"),
    (json.dumps({"model": "nope", "messages": MESSAGES}), 404, "model 'nope' not found"),
    (body(options={"temperature": "hot"}), 400, "option 'temperature' must be a number"),
    (body(options={"num_ctx": 1_000_000}), 400, "above the model's context length"),
    (body(options={"num_predict": 100_000}), 400, "option 'num_predict' is 100000"),
    (body(messages=[{"role": "user", "content": "x"}] * 1025), 400, "too many messages"),
    (body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    (json.dumps({"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"}), 400,
     "template overrides are not supported"),
])
def test_bad_requests_get_ollama_errors(api, content, status, message):
    path = "/api/generate" if b"prompt" in (content.encode() if isinstance(content, str)
                                            else content) else "/api/chat"
    r = post(api, path, content)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert "Traceback" not in r.text


def test_oversized_body_is_413(api):
    r = post(api, "/api/chat", body(messages=[{"role": "user", "content": "x" * MAX_BODY}]))
    assert r.status_code == 413 and "request body too large" in r.json()["error"]


def test_prompt_over_num_ctx_is_an_error(api):
    long = " ".join(["river"] * 200)
    client = ollama.Client(host=api.url, timeout=30)
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=[{"role": "user", "content": long}],
                    options={"num_ctx": 64})
    assert info.value.status_code == 400 and "64-token context window" in info.value.error


def test_empty_messages_and_prompt_load_the_model(api):
    client = ollama.Client(host=api.url, timeout=30)
    r = client.chat(model=MODEL, messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""
    g = client.generate(model=MODEL, prompt="")
    assert g.done and g.response == "" and g.done_reason == "load"


def test_unknown_option_is_ignored_and_logged(api):
    client = ollama.Client(host=api.url, timeout=60)
    r = client.chat(model=MODEL, messages=MESSAGES,
                    options={**GREEDY, "mirostat_wizardry": 3})
    assert r.done and r.message.content
    assert "unknown option 'mirostat_wizardry' ignored" in api.coordinator_log()


def test_client_disconnect_mid_stream_frees_every_kv_block(api):
    # Seed 5: this model's answer runs the full 400 tokens without a stop token (checked
    # first), so the request is certainly still running when the client leaves.
    request = {"model": MODEL, "messages": MESSAGES,
               "options": {"temperature": 0.9, "seed": 5, "num_predict": 400, "stop": []}}
    whole = httpx.post(api.url + "/api/chat", json={**request, "stream": False}, timeout=60).json()
    assert whole["done_reason"] == "length" and whole["eval_count"] == 400, whole
    before = api.cancelled_requests()
    with httpx.stream("POST", api.url + "/api/chat", json=request, timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
    # The connection is closed with the answer unfinished: the request must be cancelled.
    assert api.wait_cancelled(before + 1) == before + 1
    workers = api.cluster.wait_pools_full(timeout_s=30)
    assert workers and all(w["num_free_blocks"] == w["num_blocks"] for w in workers), workers


def test_64_streaming_clients_get_complete_correct_answers(api):
    prompts = [f"Tell me about river number {i}." for i in range(64)]
    options = {"temperature": 0, "num_predict": 10}

    def request(p: str, stream: bool) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": p}],
                "options": options, "stream": stream}

    with httpx.Client(timeout=60) as c:
        expected = [c.post(api.url + "/api/chat", json=request(p, False)).json()
                    for p in prompts]

    async def one(client: httpx.AsyncClient, p: str) -> tuple[str, dict]:
        async with client.stream("POST", api.url + "/api/chat", json=request(p, True)) as r:
            assert r.status_code == 200
            lines = [json.loads(line) async for line in r.aiter_lines() if line]
        assert not any("error" in line for line in lines), lines[-1]
        return "".join(line["message"]["content"] for line in lines), lines[-1]

    async def all_at_once():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(asyncio.wait_for(all_at_once(), 240))
    for want, (text, final) in zip(expected, got):
        assert final["done"] is True and final["done_reason"] == want["done_reason"]
        assert text == want["message"]["content"]
        assert final["eval_count"] == want["eval_count"]


def test_option_values_that_broke_the_sampler_are_400_and_the_cluster_serves_on(api):
    """Issue 15: each of these made torch.multinomial raise in the decode engine, which took
    the whole cluster down. Now each is a 400 (INVALID_ARGUMENT on gRPC) naming the option,
    and the same cluster answers the next request and keeps every KV block free."""
    hostile = [{"temperature": 1e308}, {"temperature": 1e-300}, {"temperature": 1e-320},
               {"repeat_penalty": 1e-300, "temperature": 0.5},
               {"frequency_penalty": -1e308, "temperature": 0.5}]
    expected = post(api, "/api/generate", json.dumps(
        {"model": MODEL, "prompt": "hi", "stream": False, "options": GREEDY})).json()["response"]
    for options in hostile:
        (name,) = [k for k in options if k != "temperature"] or ["temperature"]
        r = post(api, "/api/generate", json.dumps({"model": MODEL, "prompt": "hi",
                                                   "options": options}))
        assert r.status_code == 400 and f"option '{name}'" in r.json()["error"], r.text
        r = post(api, "/api/chat", body(options=options))
        assert r.status_code == 400 and f"option '{name}'" in r.json()["error"], r.text
        if name != "repeat_penalty":  # OpenAI has none
            r = post(api, "/v1/chat/completions", json.dumps(
                {"model": MODEL, "messages": MESSAGES, **options}))
            assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
        with TandemClient(api.grpc_target, timeout_s=30) as client:
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate(MODEL, "hi", options=options))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    again = post(api, "/api/generate", json.dumps(
        {"model": MODEL, "prompt": "hi", "stream": False, "options": GREEDY}))
    assert again.status_code == 200 and again.json()["response"] == expected
    workers = api.cluster.wait_pools_full(timeout_s=30)
    assert len(workers) == 2 and all(w["num_free_blocks"] == w["num_blocks"] for w in workers)
