"""Several models on one coordinator, with fake workers: the catalog's names, routing by the
request's model (placement, admission and keep_alive among that model's workers only), the
listings, and the 404s of a model it does not serve."""

from __future__ import annotations

import re

import httpx
import ollama
import openai
import pytest

from common.errors import ModelNotFoundError
from coordinator.config import CoordinatorConfig
from coordinator.model import load_served_model
from coordinator.model_catalog import ModelCatalog
from coordinator.registry import WorkerRegistry
from common.rpc import worker_pb2 as pb
from tests.helpers.coordinator_fakes import Script, coordinator_harness, make_tiny_model_dir, run


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # Different context lengths: different configs, so different fingerprints.
    alpha = load_served_model(make_tiny_model_dir(root / "alpha", max_position=128), "alpha")
    beta = load_served_model(make_tiny_model_dir(root / "beta", max_position=256), "beta")
    return alpha, beta


def test_the_catalog_finds_each_model_by_every_spelling_and_refuses_unknown_names(two_models):
    alpha, beta = two_models
    catalog = ModelCatalog([alpha, beta])
    assert catalog.default is alpha and len(catalog) == 2
    for name in ("alpha", "alpha:latest", "library/alpha", "registry.ollama.ai/library/alpha:latest"):
        assert catalog.get(name) is alpha
    assert catalog.get("beta:latest") is beta
    with pytest.raises(ModelNotFoundError, match="'alpha:7b' not found"):
        catalog.get("alpha:7b")


def test_the_catalog_refuses_one_file_twice_and_one_name_for_two_models(two_models, tmp_path):
    alpha, beta = two_models
    with pytest.raises(ValueError, match="same model"):
        ModelCatalog([alpha, load_served_model(alpha.path, "other")])
    with pytest.raises(ValueError, match="'alpha:latest' would name two models"):
        ModelCatalog([alpha, load_served_model(beta.path, "beta", aliases=["alpha:latest"])])


def test_a_directory_name_two_models_share_names_neither(two_models, tmp_path):
    a = load_served_model(make_tiny_model_dir(tmp_path / "a" / "model", 128), "a")
    b = load_served_model(make_tiny_model_dir(tmp_path / "b" / "model", 256), "b")
    catalog = ModelCatalog([a, b])
    assert catalog.find("model") is None
    assert catalog.get(str(a.path)).fingerprint == a.fingerprint
    assert catalog.get("b").fingerprint == b.fingerprint


def test_copies_add_a_name_to_their_own_model_only(two_models):
    alpha, beta = two_models
    catalog = ModelCatalog([alpha, beta])
    catalog.add_name(beta, "gamma")
    assert catalog.get("gamma").fingerprint == beta.fingerprint
    with pytest.raises(ValueError, match="beta"):
        catalog.add_name(alpha, "gamma")
    catalog.drop_name("gamma")
    assert catalog.find("gamma") is None and catalog.get("beta").fingerprint == beta.fingerprint


def _info(worker_id: str, role: str, fingerprint: str, layout: str) -> pb.WorkerInfo:
    # Nothing listens there: the registry opens channels lazily and this test makes no call.
    return pb.WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:1/{worker_id}",
                         kv_endpoint="tcp://x", kv_backend="zmq", model_fingerprint=fingerprint,
                         kv_layout_fingerprint=layout)


def test_the_registry_takes_each_models_workers_and_views_them_apart():
    async def scenario():
        registry = WorkerRegistry(CoordinatorConfig(), ("fa", "fb"))
        # Two models' KV layouts differ; each is compared only with its own model's workers.
        assert registry.register(_info("a-d", "decode", "fa", "layout-a")).accepted
        assert registry.register(_info("b-d", "decode", "fb", "layout-b")).accepted
        refused = registry.register(_info("a-p", "prefill", "fa", "layout-b"))
        other = registry.register(_info("c-d", "decode", "fc", "layout-c"))
        a, b = registry.view("fa"), registry.view("fb")
        seen = {"a": [w.worker_id for w in a.live()], "b": [w.worker_id for w in b.snapshots()],
                "a_gets_b": a.get("b-d"), "all": sorted(w.worker_id for w in registry.live())}
        a.mark_dead("b-d", "not a's to kill")
        seen["b_alive"] = registry.get("b-d").alive
        await registry.close()
        return refused, other, seen

    refused, other, seen = run(scenario())
    assert not refused.accepted and "KV layout" in refused.reason
    assert not other.accepted and "'fc' does not match" in other.reason
    assert seen == {"a": ["a-d"], "b": ["b-d"], "a_gets_b": None, "all": ["a-d", "b-d"],
                    "b_alive": True}
    with pytest.raises(ValueError, match="not served"):
        WorkerRegistry(CoordinatorConfig(), "fa").view("fb")


def test_each_request_reaches_only_its_models_workers(two_models):
    """Both APIs, both clients: alpha's answer is alpha's worker's tokens, beta's is beta's;
    the listings show both with their tag; an unknown model is each API's 404; keep_alive 0
    unloads one model's workers and leaves the other's loaded."""
    alpha, beta = two_models
    a_tokens = alpha.tokenizer.encode("Hi!", add_special_tokens=False)
    b_tokens = beta.tokenizer.encode("Yo?", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness([alpha, beta], prefill_threshold=0) as h:
            a_pre = await h.add_worker("a-p", "prefill", Script(tokens=a_tokens))
            a_dec = await h.add_worker("a-d", "decode", Script(tokens=a_tokens))
            b_pre = await h.add_worker("b-p", "prefill", Script(tokens=b_tokens),
                                       fingerprint=beta.fingerprint)
            b_dec = await h.add_worker("b-d", "decode", Script(tokens=b_tokens),
                                       fingerprint=beta.fingerprint)
            oc = ollama.AsyncClient(host=h.url, timeout=30)
            out = {"tags": [m.model for m in (await oc.list()).models],
                   "ps": sorted(m.model for m in (await oc.ps()).models),
                   "show": (await oc.show("beta:latest")).modelinfo["llama.context_length"]}
            for name in ("alpha", "beta:latest"):
                reply = await oc.chat(model=name, messages=[{"role": "user", "content": "x"}])
                out[name] = (reply.model, reply.message.content)
            try:
                await oc.chat(model="gamma", messages=[{"role": "user", "content": "x"}])
            except ollama.ResponseError as exc:
                out["ollama_404"] = exc.status_code
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x",
                                          max_retries=0) as oai:
                out["v1_models"] = [m.id for m in (await oai.models.list()).data]
                done = await oai.chat.completions.create(
                    model="beta", messages=[{"role": "user", "content": "x"}])
                out["openai_beta"] = done.choices[0].message.content
                done = await oai.completions.create(model="alpha:latest", prompt="x")
                out["openai_alpha"] = done.choices[0].text
                try:
                    await oai.chat.completions.create(
                        model="gamma", messages=[{"role": "user", "content": "x"}])
                except openai.NotFoundError as exc:
                    out["openai_404"] = exc.code
            out["requests"] = {w.worker_id: len(w.requests) for w in (a_pre, a_dec, b_pre, b_dec)}
            # keep_alive 0 for alpha alone
            await oc.chat(model="alpha", messages=[], keep_alive=0)
            out["residency"] = {w.worker_id: list(w.residency_calls)
                                for w in (a_pre, a_dec, b_pre, b_dec)}
            out["ps_after"] = [m.model for m in (await oc.ps()).models]
            async with httpx.AsyncClient(base_url=h.url, timeout=30) as http:
                out["health"] = (await http.get("/health")).json()["status"]
                out["metrics"] = (await http.get("/metrics")).text
            return out

    out = run(scenario())
    assert out["tags"] == ["alpha:latest", "beta:latest"]
    assert out["ps"] == ["alpha:latest", "beta:latest"] and out["show"] == 256
    assert out["alpha"] == ("alpha", "Hi!") and out["beta:latest"] == ("beta", "Yo?")
    assert out["v1_models"] == ["alpha:latest", "beta:latest"]
    assert out["openai_beta"] == "Yo?" and out["openai_alpha"] == "Hi!"
    assert out["ollama_404"] == 404 and out["openai_404"] == "model_not_found"
    # Two requests each (alpha: a chat, a completion; beta: two chats), prefilled remotely.
    assert out["requests"] == {"a-p": 2, "a-d": 2, "b-p": 2, "b-d": 2}
    assert out["residency"] == {"a-p": [False], "a-d": [False], "b-p": [], "b-d": []}
    assert out["ps_after"] == ["beta:latest"] and out["health"] == "ok"
    # Each request counts under its own model's model_name (vLLM's label).
    for name in ("alpha", "beta"):
        assert re.search(rf'^vllm:e2e_request_latency_seconds_count\{{model_name="{name}"\}} 2\.0$',
                         out["metrics"], re.M), name
        assert f'vllm:num_requests_running{{model_name="{name}"}} 0.0' in out["metrics"]


def test_a_model_without_workers_is_refused_while_the_other_serves(two_models):
    alpha, beta = two_models
    b_tokens = beta.tokenizer.encode("Yo", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness([alpha, beta]) as h:
            await h.add_worker("b-c", "colocated", Script(tokens=b_tokens),
                               fingerprint=beta.fingerprint)
            async with httpx.AsyncClient(base_url=h.url, timeout=30) as http:
                body = {"messages": [{"role": "user", "content": "x"}], "stream": False}
                a = await http.post("/api/chat", json={"model": "alpha", **body})
                b = await http.post("/api/chat", json={"model": "beta", **body})
                health = await http.get("/health")
            return a, b, health

    a, b, health = run(scenario())
    assert a.status_code == 503 and "of alpha" in a.json()["error"]
    assert b.status_code == 200 and b.json()["message"]["content"] == "Yo"
    assert health.status_code == 503 and "serves alpha" in health.json()["reason"]
