"""The response cache through the client APIs of a real cluster (tiny random model, exact mode,
two API keys): hits on /api/chat, /api/generate, /v1/chat/completions and /v1/completions,
streamed like a computed answer; misses when an option differs; sampled requests only when the
client opts in; tenants apart; the bound and /metrics. The semantic mode's quality is measured
on the default model (test_response_cache_semantic.py)."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from coordinator.client import TandemClient
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.cluster import running_cluster

KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}
MAX_ENTRIES = 12
GREEDY = {"temperature": 0, "num_predict": 6}


GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("rcache")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    keys_file = root / "keys"
    keys_file.write_text("".join(f"{n} {k}\n" for n, k in KEYS.items()))
    before = os.environ.get("TANDEM_API_KEYS_FILE")
    os.environ["TANDEM_API_KEYS_FILE"] = str(keys_file)  # the coordinator inherits it
    try:
        with running_cluster(model_dir, root / "logs", worker_args=(
                "--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32"),
                coordinator_args=("--response-cache", f"exact:entries={MAX_ENTRIES}",
                                  "--grpc-port", str(GRPC_PORT))) as c:
            yield c.url
    finally:
        if before is None:
            os.environ.pop("TANDEM_API_KEYS_FILE", None)
        else:
            os.environ["TANDEM_API_KEYS_FILE"] = before


def post(url: str, path: str, body: dict, tenant: str = "alice") -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    return r


def chat(text: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "stream": False,
            "options": dict(GREEDY), **extra}


def answer(path: str, r: httpx.Response) -> str:
    body = r.json()
    if path == "/api/chat":
        return body["message"]["content"]
    if path == "/api/generate":
        return body["response"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def cache_field(path: str, r: httpx.Response) -> str:
    return r.json()["tandem"]["cache"]


BODIES = {
    "/api/chat": chat("Name three rivers."),
    # (the same prompt as the chat's would render to its prompt ids, and hit its answer)
    "/api/generate": {"model": "tiny", "prompt": "Name three lakes.", "stream": False,
                      "options": dict(GREEDY)},
    "/v1/chat/completions": {"model": "tiny", "temperature": 0, "max_tokens": 6,
                             "messages": [{"role": "user", "content": "Name three seas."}]},
    "/v1/completions": {"model": "tiny", "prompt": "Name three hills.", "temperature": 0,
                        "max_tokens": 6, "logprobs": 2},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_an_identical_deterministic_request_is_a_hit_on_every_api(url, path):
    first = post(url, path, BODIES[path])
    again = post(url, path, BODIES[path])
    assert first.headers["X-Tandem-Cache"] == cache_field(path, first) == "miss"
    assert again.headers["X-Tandem-Cache"] == cache_field(path, again) == "hit"
    assert answer(path, again) == answer(path, first) and answer(path, first)
    if path == "/v1/completions":  # logprobs come back with their tokens
        assert again.json()["choices"][0]["logprobs"] == first.json()["choices"][0]["logprobs"]
    if path.startswith("/v1/"):  # none of the prompt was computed again
        usage = again.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] > 0
        assert usage["completion_tokens"] == first.json()["usage"]["completion_tokens"]
    if path.startswith("/api/"):
        a, b = first.json(), again.json()
        assert b["eval_count"] == a["eval_count"] and b["done_reason"] == a["done_reason"]
        assert b["tandem"]["decode_worker"] is None  # no worker computed it


def _ndjson(r: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_generate_hits_the_chat_that_renders_the_same_prompt(url):
    """/api/generate without raw is one user message through the template: the same prompt
    ids and options as such a chat, so the same answer."""
    chatted = post(url, "/api/chat", chat("Same prompt, two routes."))
    generated = post(url, "/api/generate", {"model": "tiny", "prompt": "Same prompt, two routes.",
                                            "stream": False, "options": dict(GREEDY)})
    assert generated.headers["X-Tandem-Cache"] == "hit"
    assert generated.json()["response"] == chatted.json()["message"]["content"]


def test_the_responses_api_and_grpc_go_through_the_cache(url):
    body = {"model": "tiny", "input": "Respond twice.", "temperature": 0, "max_output_tokens": 5}
    first, again = post(url, "/v1/responses", body), post(url, "/v1/responses", body)
    assert (first.headers["X-Tandem-Cache"], again.headers["X-Tandem-Cache"]) == ("miss", "hit")
    # gRPC's Chat stores what /api/chat then finds: the same prompt, options and tenant
    with TandemClient(f"127.0.0.1:{GRPC_PORT}", api_key=KEYS["alice"]) as client:
        text = client.chat_text("tiny", [{"role": "user", "content": "Over gRPC first."}],
                                options=GREEDY)
    r = post(url, "/api/chat", chat("Over gRPC first."))
    assert r.headers["X-Tandem-Cache"] == "hit" and answer("/api/chat", r) == text


def test_grpc_reports_the_cache_and_takes_the_opt_in(url):
    """Figures.cache on the last message of each gRPC stream, as X-Tandem-Cache over HTTP;
    Options.cache opts a sampled request in (true) or out (false)."""
    def outcome(call) -> tuple[str, str]:
        replies = list(call)
        assert replies[-1].done and all(not r.done for r in replies[:-1])
        return replies[-1].figures.cache, "".join(r.message.content for r in replies)

    sampled = {"temperature": 0.9, "num_predict": 5}
    with TandemClient(f"127.0.0.1:{GRPC_PORT}", api_key=KEYS["alice"]) as client:
        def ask(text: str, options: dict) -> tuple[str, str]:
            return outcome(client.chat("tiny", [{"role": "user", "content": text}],
                                       options=options))

        first, again = ask("gRPC marks hits.", GREEDY), ask("gRPC marks hits.", GREEDY)
        assert (first[0], again[0]) == ("miss", "hit") and first[1] == again[1]
        assert [ask("gRPC samples.", sampled)[0] for _ in range(2)] == ["bypass", "bypass"]
        opted = [ask("gRPC opts in.", sampled | {"cache": True}) for _ in range(2)]
        assert [o[0] for o in opted] == ["miss", "hit"] and opted[0][1] == opted[1][1]
        assert ask("gRPC marks hits.", GREEDY | {"cache": False})[0] == "bypass"
        replies = list(client.generate("tiny", "gRPC generates twice.", options=GREEDY))
        again = list(client.generate("tiny", "gRPC generates twice.", options=GREEDY))
        assert (replies[-1].figures.cache, again[-1].figures.cache) == ("miss", "hit")


def test_a_hit_streams_like_the_computed_answer_ollama(url):
    body = {**chat("Stream me a hit."), "stream": True}
    first, again = post(url, "/api/chat", body), post(url, "/api/chat", body)
    assert (first.headers["X-Tandem-Cache"], again.headers["X-Tandem-Cache"]) == ("miss", "hit")
    a, b = _ndjson(first), _ndjson(again)
    assert [x["message"]["content"] for x in b] == [x["message"]["content"] for x in a]
    assert [x["done"] for x in b] == [x["done"] for x in a] and b[-1]["done"]
    assert b[-1]["tandem"]["cache"] == "hit" and b[-1]["eval_count"] == a[-1]["eval_count"]


def test_a_hit_streams_like_the_computed_answer_openai(url):
    body = {**BODIES["/v1/chat/completions"], "stream": True,
            "messages": [{"role": "user", "content": "Stream an SSE hit."}]}

    def events(r: httpx.Response) -> list:
        data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
                for c in map(json.loads, data[:-1])]

    def marks(r: httpx.Response) -> list:
        data = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
        return [c.get("tandem") for c in data]

    first, again = post(url, "/v1/chat/completions", body), post(url, "/v1/chat/completions", body)
    assert again.headers["X-Tandem-Cache"] == "hit"
    assert events(again) == events(first)
    # the finishing chunk says it too (a client that reads no headers: the openai SDK)
    for r, state in ((first, "miss"), (again, "hit")):
        assert marks(r)[-1] == {"cache": state} and not any(marks(r)[:-1])
    completion = {**BODIES["/v1/completions"], "stream": True, "prompt": "Stream a text hit."}
    for state in ("miss", "hit"):
        assert marks(post(url, "/v1/completions", completion))[-1] == {"cache": state}


@pytest.mark.parametrize("change", [
    {"options": {**GREEDY, "num_predict": 5}},
    {"options": {**GREEDY, "stop": ["a"]}},
    {"options": {**GREEDY, "seed": 11, "temperature": 0.7}},
    {"options": {**GREEDY, "repeat_penalty": 1.5}},
    {"options": {**GREEDY, "top_k": 1}},
    {"options": {**GREEDY, "min_tokens": 3}},
    {"format": "json"},
    {"logprobs": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Options differ."}]},
])
def test_a_request_whose_options_differ_is_never_served(url, change):
    base = chat("Options differ.")
    assert post(url, "/api/chat", base).headers["X-Tandem-Cache"] in ("miss", "hit")
    changed = post(url, "/api/chat", {**base, **change})
    assert changed.headers["X-Tandem-Cache"] == "miss"


def test_sampled_requests_are_cached_only_when_the_client_opts_in(url):
    sampled = chat("Sample me.", options={"temperature": 0.9, "num_predict": 6})
    assert [post(url, "/api/chat", sampled).headers["X-Tandem-Cache"] for _ in range(2)] == \
        ["bypass", "bypass"]
    opted = chat("Sample me.", options={"temperature": 0.9, "num_predict": 6, "cache": True})
    first, again = post(url, "/api/chat", opted), post(url, "/api/chat", opted)
    assert (first.headers["X-Tandem-Cache"], again.headers["X-Tandem-Cache"]) == ("miss", "hit")
    assert answer("/api/chat", again) == answer("/api/chat", first)
    # OpenAI's default temperature is 1: sampled; `cache` is a body field (extra_body)
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Sample me."}]}
    assert post(url, "/v1/chat/completions", body).headers["X-Tandem-Cache"] == "bypass"
    body["cache"] = True
    post(url, "/v1/chat/completions", body)
    assert post(url, "/v1/chat/completions", body).headers["X-Tandem-Cache"] == "hit"
    # and a deterministic request that opts out
    out = chat("Opt out.", options={**GREEDY, "cache": False})
    assert [post(url, "/api/chat", out).headers["X-Tandem-Cache"] for _ in range(2)] == \
        ["bypass", "bypass"]


def test_one_api_keys_answers_are_never_served_to_another(url):
    body = chat("A secret of alice's.")
    assert post(url, "/api/chat", body, "alice").headers["X-Tandem-Cache"] == "miss"
    assert post(url, "/api/chat", body, "alice").headers["X-Tandem-Cache"] == "hit"
    assert post(url, "/api/chat", body, "bob").headers["X-Tandem-Cache"] == "miss"
    assert post(url, "/api/chat", body, "bob").headers["X-Tandem-Cache"] == "hit"


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(tandem_response_cache_\S+) (\S+)$", text, re.M)}


def test_metrics_move_and_the_bound_holds(url):
    before = _metrics(url)
    for i in range(MAX_ENTRIES + 3):
        post(url, "/api/chat", chat(f"Distinct question number {i}."))
    post(url, "/api/chat", chat(f"Distinct question number {MAX_ENTRIES + 2}."))
    after = _metrics(url)
    hits = 'tandem_response_cache_hits_total{kind="exact"}'
    assert after[hits] == before[hits] + 1
    assert after["tandem_response_cache_misses_total"] >= \
        before["tandem_response_cache_misses_total"] + MAX_ENTRIES + 3
    assert after["tandem_response_cache_entries"] == MAX_ENTRIES
    assert after["tandem_response_cache_evictions_total"] >= \
        before["tandem_response_cache_evictions_total"] + 3
    assert 0 < after["tandem_response_cache_bytes"]
