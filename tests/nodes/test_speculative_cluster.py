"""Speculation on a real decode worker process: a disaggregated cluster (prefill and decode
workers as processes, every prompt prefilled remotely) started with --speculative ngram, or
draft with the model drafting for itself, on every worker's command line. The decode worker speculates after the KV handoff and answers
what plain decoding answers; the prefill worker ignores the flag; the counters reach the
coordinator's /internal/workers and /metrics under vLLM's names."""

from __future__ import annotations

import time
import urllib.request

import pytest

from prometheus_client.parser import text_string_to_metric_families

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.generation import TextStream, chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.cluster import running_cluster

WORKER_ARGS = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
CONTENT = "the river and the city, the river and the city, the river and the city of the king"
N = 40


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_decode_worker_speculates_and_answers_as_plain_decoding(tmp_path, method):
    tiny = make_tiny_hf_model(tmp_path / "m", "llama", max_position=1024)
    spec_flag = "ngram:k=4" if method == "ngram" else f"draft:{tiny},k=4"
    reference = LLMEngine.from_path(tiny, EngineConfig(cache=CacheConfig(num_blocks=256)))
    messages = [{"role": "user", "content": CONTENT}]
    ids = chat_prompt_ids(reference, messages)
    expected = "".join(TextStream(reference, ids, SamplingParams(temperature=0.0, num_predict=N)))
    with running_cluster(tiny, tmp_path / "logs", prefill=1, decode=1, prefill_threshold=0,
                         worker_args=(*WORKER_ARGS, "--speculative", spec_flag)) as cluster:
        answer = cluster.chat(messages, options={"temperature": 0, "num_predict": N})
        assert answer["message"]["content"] == expected
        assert answer["tandem"]["prefill_worker"]  # the disaggregated path
        deadline = time.monotonic() + 20
        while True:  # the counters travel with the heartbeats
            workers = {w["role"]: w for w in cluster.workers() if w["alive"]}
            spec = workers["decode"]["spec_decode"]
            if (spec and spec["num_steps"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert workers["prefill"]["spec_decode"] is None
        assert spec["num_steps"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_tokens"]
        assert spec["num_emitted_tokens"] == spec["num_steps"] + spec["num_accepted_tokens"]
        assert spec["method"] == method
        if method == "draft":  # its own draft: the decode worker's draft prefilled the prompt
            assert spec["num_accepted_tokens"] >= 0.9 * spec["num_draft_tokens"] > 0
        with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for family in text_string_to_metric_families(metrics) for x in family.samples}
        labels = (("method", method), ("role", "decode"), ("worker", workers["decode"]["worker_id"]))
        assert samples[("vllm:spec_decode_num_draft_tokens_total", labels)] == spec["num_draft_tokens"]
        assert (samples[("vllm:spec_decode_num_accepted_tokens_total", labels)]
                == spec["num_accepted_tokens"])
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in cluster.wait_pools_full())
