"""OpenAI's logit_bias and vLLM's ignore_eos, min_tokens and stop_token_ids (as a benchmark
tool or the openai client's extra_body sends them), through the real `openai` client.

- The coordinator alone (fake workers): what reaches the worker (SamplingOptions, the stop
  set), and the 400s naming the field.
- A real cluster whose every prompt is prefilled remotely, so each control applies to the
  first token, sampled by the prefill worker, as well as to the decode worker's. Greedy on a
  tiny random model whose logits are small: a +100 bias decides every choice.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from coordinator.model import load_served_model
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.cluster import running_cluster
from tests.helpers.coordinator_fakes import (
    Script, coordinator_harness, make_tiny_model_dir, openai_refusal, run,
)

WORKER_ARGS = ("--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32")
MESSAGES = [{"role": "user", "content": "Hi"}]
EOS = 2  # "<|im_end|>" in reliability/model_factory.py's vocabulary: a stop token
A, B = 70, 71  # two ordinary tokens


# ---- the coordinator alone ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_served_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")), "tiny")


def test_the_controls_reach_the_worker(model):
    tokens = model.tokenizer.encode("Hello", add_special_tokens=False)
    model_stops = sorted(model.tokenizer.stop_token_ids)

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=10_000) as h:
            worker = await h.add_worker("d1", "colocated", Script(tokens=tokens))
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x") as oai:
                await oai.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=9, logit_bias={str(A): 100},
                    extra_body={"min_tokens": 4, "stop_token_ids": [B]})
                await oai.completions.create(model="tiny", prompt="x", max_tokens=5,
                                             extra_body={"ignore_eos": True})
                await oai.completions.create(model="tiny", prompt="x", extra_body={
                    "ignore_eos": True, "stop_token_ids": [A]})
            async with httpx.AsyncClient(base_url=h.url) as raw:  # tandem's Ollama extension
                r = await raw.post("/api/generate", json={"model": "tiny", "prompt": "x",
                                                          "stream": False,
                                                          "options": {"min_tokens": 3}})
                assert r.status_code == 200, r.text
            return worker

    first, no_eos, own_stop, ollama_min = run(scenario()).requests
    assert ollama_min.sampling.min_tokens == 3
    assert first.sampling.min_tokens == 4 and dict(first.sampling.logit_bias) == {A: 100.0}
    assert list(first.stop_token_ids) == sorted({*model_stops, B})
    assert list(no_eos.stop_token_ids) == [] and no_eos.max_tokens == 5
    assert list(own_stop.stop_token_ids) == [A]


@pytest.mark.parametrize("extra,message", [
    ({"logit_bias": {"5": 101}}, "'logit_bias[5]' must be between -100 and 100"),
    ({"logit_bias": {"abc": 1}}, "logit_bias: a token id must be an integer"),
    ({"logit_bias": {"99999": 1}}, "logit_bias 99999 is outside the vocabulary"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias takes at most 300 token ids"),
    ({"stop_token_ids": [99999]}, "stop_token_ids 99999 is outside the vocabulary"),
    ({"stop_token_ids": "2"}, "stop_token_ids must be a list of token ids"),
    ({"min_tokens": -1}, "'min_tokens' must be between 0"),
    ({"min_tokens": 5, "max_tokens": 4}, "'min_tokens' (5) is more than num_predict (4)"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_bad_controls_are_a_400_naming_the_field(model, extra, message):
    error = openai_refusal(model, extra, chat=False)
    assert error.status_code == 400 and message in error.body["message"], error.body


# ---- a real cluster: every first token sampled by the prefill worker ------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("controls")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    with running_cluster(model_dir, root / "logs", model="tiny", worker_args=WORKER_ARGS,
                         prefill_threshold=0) as running:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="x", timeout=120,
                            max_retries=0)


def complete(client: openai.OpenAI, max_tokens: int, **extra):
    """A greedy completion: (its choice, its completion token count)."""
    logit_bias = extra.pop("logit_bias", None)
    r = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0,
                                  max_tokens=max_tokens, logit_bias=logit_bias,
                                  extra_body=extra, logprobs=0)
    return r.choices[0], r.usage.completion_tokens


def test_logit_bias_forces_and_forbids_tokens(cluster):
    forced, n = complete(cluster, 5, logit_bias={str(A): 100, str(B): 90})
    second, m = complete(cluster, 5, logit_bias={str(A): -100, str(B): 90})
    # Each entry is one token (the first from the prefill worker); all A, then all B.
    a, b = forced.logprobs.tokens, second.logprobs.tokens
    assert n == m == 5 and len(set(a)) == 1 and len(set(b)) == 1 and a != b
    chat = cluster.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                           max_tokens=3, logit_bias={str(A): 100})
    assert chat.choices[0].message.content == "".join(a[:3])


def test_ignore_eos_generates_exactly_max_tokens(cluster):
    eos_first = {"logit_bias": {str(EOS): 100}}  # greedy would stop at once
    stopped, n = complete(cluster, 8, **eos_first)
    assert stopped.finish_reason == "stop" and n == 1  # the stop token counts, as in vLLM
    full, n = complete(cluster, 8, ignore_eos=True, **eos_first)
    assert full.finish_reason == "length" and n == 8


def test_min_tokens_holds_the_stop_tokens_back(cluster):
    early, n = complete(cluster, 12, min_tokens=5, logit_bias={str(EOS): 100})
    # Tokens 1-5 (the first sampled by the prefill worker) cannot be a stop token; the sixth is.
    tokens = early.logprobs.tokens
    assert early.finish_reason == "stop" and n == 6 and tokens[-1] == "<|im_end|>"
    assert "<|im_end|>" not in tokens[:-1]


def test_stop_token_ids_end_the_answer(cluster):
    first, n = complete(cluster, 12, stop_token_ids=[A], logit_bias={str(A): 100})
    assert first.finish_reason == "stop" and n == 1  # the prefill worker's first token stops it
    later, n = complete(cluster, 12, stop_token_ids=[A], min_tokens=3, logit_bias={str(A): 100})
    assert later.finish_reason == "stop" and n == 4  # the decode worker's fourth does
    assert later.logprobs.tokens[-1] == first.logprobs.tokens[0]
