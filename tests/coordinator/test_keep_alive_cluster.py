"""keep_alive on a real cluster (a prefill and a decode worker as processes): keep_alive 0
drops the weights on every worker, the next request reloads them (load_duration > 0) and
answers as before, and one within keep_alive waits for nothing."""

from __future__ import annotations

import json
import time
import urllib.request

from engine.generation import TextStream, chat_prompt_ids
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.helpers.cluster import running_cluster
from reliability.model_factory import make_tiny_hf_model

FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
CONTENT = "the river and the city of the old king"
N = 12


def ps(cluster) -> list[dict]:
    with urllib.request.urlopen(cluster.url + "/api/ps", timeout=10) as r:
        return json.loads(r.read())["models"]


def wait_resident(cluster, resident: bool, timeout_s: float = 20.0) -> list[dict]:
    """Heartbeats carry each worker's residency; polls until every live one reports it."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for w in cluster.workers() if w["alive"]]
        if all(w["resident"] is resident for w in workers) or time.monotonic() > deadline:
            return workers
        time.sleep(0.1)


def test_keep_alive_0_drops_the_weights_and_the_next_request_reloads_them(tmp_path):
    tiny = make_tiny_hf_model(tmp_path / "m", "llama", max_position=1024)
    reference = LLMEngine.from_path(tiny, EngineConfig(cache=CacheConfig(num_blocks=256)))
    ids = chat_prompt_ids(reference, [{"role": "user", "content": CONTENT}])
    expected = "".join(TextStream(reference, ids, SamplingParams(temperature=0.0, num_predict=N)))
    options = {"temperature": 0, "num_predict": N}
    messages = [{"role": "user", "content": CONTENT}]
    with running_cluster(tiny, tmp_path / "logs", prefill=1, decode=1, prefill_threshold=0,
                         worker_args=FP32) as cluster:
        first = cluster.chat(messages, options=options, keep_alive=0)
        assert first["message"]["content"] == expected
        workers = wait_resident(cluster, False)
        assert len(workers) == 2 and all(w["resident"] is False for w in workers), workers
        assert ps(cluster) == []

        second = cluster.chat(messages, options=options)  # the default keep_alive (5m)
        assert second["message"]["content"] == expected
        assert second["load_duration"] > 0
        assert second["tandem"]["prefill_worker"]  # the disaggregated path, reloaded on both
        (entry,) = ps(cluster)
        assert entry["expires_at"] != "2318-01-01T00:00:00Z"
        assert all(w["resident"] for w in wait_resident(cluster, True))

        third = cluster.chat(messages, options=options, keep_alive="5m")
        assert third["message"]["content"] == expected and third["load_duration"] == 0
