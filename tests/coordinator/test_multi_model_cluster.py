"""`tandem serve --model A --model B` as processes: one coordinator, a prefill and a decode
worker per model (deploy.process_plan's plan, as the CLI builds it), two tiny random models of
different families. Each answers through the real ollama and openai clients with its own
greedy output (what transformers-equal engines of each model write), each request is
prefilled and decoded by its own model's workers, /api/tags lists both with their tag,
LangChain's ChatOllama validates `NAME:latest`, an unknown model is each API's 404, and every
KV block is free at the end."""

from __future__ import annotations

import json
import urllib.request

import ollama
import openai
import pytest

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.generation import TextStream, chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.cluster import running_cluster

FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
MESSAGES = [{"role": "user", "content": "the river and the city of the old king"}]
N = 10


def _greedy(path) -> str:
    engine = LLMEngine.from_path(path, EngineConfig(cache=CacheConfig(num_blocks=64)))
    ids = chat_prompt_ids(engine, MESSAGES)
    return "".join(TextStream(engine, ids, SamplingParams(temperature=0.0, num_predict=N)))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    alpha = make_tiny_hf_model(root / "alpha", "llama", seed=0)
    beta = make_tiny_hf_model(root / "beta", "qwen3", seed=1)
    expected = {"alpha": _greedy(alpha), "beta": _greedy(beta)}
    assert expected["alpha"] != expected["beta"]  # else the routing checks below prove nothing
    with running_cluster(alpha, root / "logs", model="alpha", worker_args=FP32,
                         prefill_threshold=0, more_models=(("beta", beta),)) as cluster:
        yield cluster, expected


def _get(cluster, path: str) -> dict:
    with urllib.request.urlopen(cluster.url + path, timeout=10) as r:
        return json.loads(r.read())


def test_both_models_answer_through_ollama_and_openai_each_on_its_own_workers(served):
    cluster, expected = served
    report = _get(cluster, "/internal/workers")
    fingerprints = {m["name"]: m["model_fingerprint"] for m in report["models"]}
    of_model = {w["worker_id"]: w["model_fingerprint"] for w in report["workers"]}
    assert of_model == {"prefill-0": fingerprints["alpha"], "decode-0": fingerprints["alpha"],
                        "beta-prefill-0": fingerprints["beta"],
                        "beta-decode-0": fingerprints["beta"]}

    options = {"temperature": 0, "num_predict": N}
    client = ollama.Client(host=cluster.url, timeout=120)
    oai = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    for name, prefix in (("alpha", ""), ("beta", "beta-")):
        reply = client.chat(model=f"{name}:latest", messages=MESSAGES, options=options)
        assert (reply.model, reply.message.content) == (name, expected[name])
        done = oai.chat.completions.create(model=name, messages=MESSAGES, temperature=0,
                                           max_tokens=N)
        assert done.choices[0].message.content == expected[name]
        raw = cluster.chat(MESSAGES, model=name, options=options)
        assert (raw["tandem"]["prefill_worker"], raw["tandem"]["decode_worker"]) == (
            f"{prefix}prefill-0", f"{prefix}decode-0")
        assert raw["message"]["content"] == expected[name]

    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="gamma", messages=MESSAGES)
    assert refused.value.status_code == 404
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.chat.completions.create(model="gamma", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"

    workers = cluster.wait_pools_full()
    assert len(workers) == 4 and all(w["num_free_blocks"] == w["num_blocks"] for w in workers)


def test_the_listings_show_both_models_with_their_tag(served):
    cluster, _ = served
    assert [m["name"] for m in _get(cluster, "/api/tags")["models"]] == ["alpha:latest",
                                                                        "beta:latest"]
    assert [m["id"] for m in _get(cluster, "/v1/models")["data"]] == ["alpha:latest",
                                                                     "beta:latest"]
    client = ollama.Client(host=cluster.url, timeout=60)
    assert client.show("beta").modelinfo["general.architecture"] == "qwen3"
    assert client.show("alpha:latest").modelinfo["general.architecture"] == "llama"
    assert sorted(m.model for m in client.ps().models) == ["alpha:latest", "beta:latest"]


def test_langchain_validates_and_chats_with_either_model(served):
    from langchain_ollama import ChatOllama

    cluster, expected = served
    for name in ("alpha", "beta"):
        chat = ChatOllama(model=f"{name}:latest", base_url=cluster.url,
                          validate_model_on_init=True, temperature=0, num_predict=N)
        assert chat.invoke(MESSAGES[0]["content"]).content == expected[name]
    with pytest.raises(ValueError, match="not found"):
        ChatOllama(model="gamma:latest", base_url=cluster.url, validate_model_on_init=True)
