"""`tandem serve NAME` of a model in Ollama's store (a fake one, in Ollama's real layout) as
processes: the model's params layer gives each request its defaults under the request's own
options, and its system layer opens every chat that has no system message, on /api/chat,
/api/generate and /v1/chat/completions, as Ollama applies them; /api/show reports both.
Answers are checked against a local engine's greedy output of the same prompt."""

from __future__ import annotations

import json
import urllib.request

import ollama
import openai
import pytest

from common.model_store import ModelStore, default_home
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.generation import TextStream, chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_gguf
from tests.helpers.cluster import running_cluster
from tests.helpers.foreign_stores import make_ollama_store

FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
SYSTEM = "You are tiny."
PARAMS = {"temperature": 0, "num_predict": 4, "top_k": 1, "stop": ["<|im_end|>"]}
USER = [{"role": "user", "content": "the river and the city"}]
OTHER = [{"role": "system", "content": "You are an old king."}, *USER]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    gguf = make_tiny_gguf(root / "tiny.gguf").path
    engine = LLMEngine.from_path(gguf, EngineConfig(cache=CacheConfig(num_blocks=64)))

    def greedy(messages, n):
        """(prompt tokens, greedy text): the prompt's length tells which system it had (a
        random tiny model may well answer alike after either)."""
        ids = chat_prompt_ids(engine, messages)
        return len(ids), "".join(TextStream(engine, ids, SamplingParams(temperature=0.0,
                                                                        num_predict=n)))

    expected = {"system": greedy([{"role": "system", "content": SYSTEM}, *USER], 4),
                "bare": greedy(USER, 4), "other": greedy(OTHER, 6)}
    assert len({expected[k][0] for k in expected}) == 3  # three prompts, told apart by length
    store = make_ollama_store(root / "ollama", gguf, params=PARAMS, system=SYSTEM)
    blob = next(p for p in (store / "blobs").iterdir() if p.stat().st_size == gguf.stat().st_size)
    # TANDEM_HOME stays (the workers' native kernels are built there); "tiny" must be this
    # Ollama store's there, as the coordinator will resolve it.
    assert ModelStore(default_home(), ollama_models=store).resolve("tiny") == blob
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OLLAMA_MODELS", str(store))  # the coordinator's store, as Ollama's is read
        with running_cluster(blob, root / "logs", model="tiny", store_name="tiny",
                             worker_args=FP32, prefill_threshold=0) as cluster:
            yield cluster, expected


def test_chat_takes_the_model_options_and_system_under_its_own(served):
    cluster, expected = served
    reply = cluster.chat(USER)  # no options: temperature 0 and num_predict 4 are the model's
    assert (reply["prompt_eval_count"], reply["message"]["content"]) == expected["system"]
    assert (reply["eval_count"], reply["done_reason"]) == (4, "length")
    own = cluster.chat(OTHER, options={"num_predict": 6})  # its own system and length win
    assert (own["prompt_eval_count"], own["message"]["content"]) == expected["other"]
    assert own["eval_count"] == 6
    client = ollama.Client(host=cluster.url, timeout=120)
    listed = client.chat(model="tiny:latest", messages=USER)
    assert (listed.prompt_eval_count, listed.message.content) == expected["system"]


def test_generate_and_openai_apply_them_too(served):
    cluster, expected = served
    client = ollama.Client(host=cluster.url, timeout=120)
    made = client.generate(model="tiny", prompt=USER[0]["content"])
    assert (made.prompt_eval_count, made.response) == expected["system"]
    override = client.generate(model="tiny", prompt=USER[0]["content"], system=OTHER[0]["content"],
                               options={"num_predict": 6})
    assert (override.prompt_eval_count, override.response) == expected["other"]
    oai = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    # OpenAI's temperature default (1.0) is always sent, as Ollama's layer sends it: asked for 0.
    done = oai.chat.completions.create(model="tiny", messages=USER, temperature=0)
    # The model's system prompt, and its num_predict (4) with no max_tokens.
    assert (done.usage.prompt_tokens, done.choices[0].message.content) == expected["system"]
    assert done.usage.completion_tokens == 4


def test_show_reports_the_parameters_and_system(served):
    cluster, _ = served
    req = urllib.request.Request(cluster.url + "/api/show", data=json.dumps(
        {"model": "tiny"}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        shown = json.loads(r.read())
    assert shown["system"] == SYSTEM
    assert shown["parameters"].split("\n") == [
        f"{'temperature':<30} 0", f"{'num_predict':<30} 4", f"{'top_k':<30} 1",
        f"{'stop':<30} \"<|im_end|>\""]
    client = ollama.Client(host=cluster.url, timeout=10)
    assert client.show("tiny:latest").parameters == shown["parameters"]
    assert 'SYSTEM """You are tiny."""' in client.show("tiny").modelfile
    workers = cluster.wait_pools_full()
    assert workers and all(w["num_free_blocks"] == w["num_blocks"] for w in workers)
