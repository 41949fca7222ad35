"""A `tandem serve --batch-invariant` cluster (coordinator, prefill and decode processes) on the
default model with its default formats (fp32 prefill, int4 decode): a greedy chat answers the
same tokens and logprobs, bit for bit, on a miss, on a prefix-cache hit and beside other chats.
Before the mode, the hit's short uncached part ran on the decode worker in int4 and the fp32
GEMMs' sums depended on their row counts: the same chat answered other words after ~20 tokens."""

from __future__ import annotations

import concurrent.futures

import pytest

from tests.helpers.cluster import running_cluster

pytestmark = pytest.mark.model

MODEL = "smollm2"
# Long enough (~290 tokens) that the first chat is prefilled on the prefill worker.
SYSTEM = {"role": "system", "content": " ".join(
    ["You are a careful travel guide who knows the history of every European city, its rivers, "
     "bridges, museums, markets and people, and who answers with facts."] * 8)}


def ask(cluster, question: str):
    body = cluster.chat([SYSTEM, {"role": "user", "content": question}], model=MODEL,
                        options={"temperature": 0, "num_predict": 32}, logprobs=True)
    return body["message"]["content"], [(e["token"], e["logprob"]) for e in body["logprobs"]]


def test_a_repeated_chat_answers_the_same_bit_for_bit(default_gguf, tmp_path):
    question = "Tell me about the city of Paris, its history, its people and its culture."
    with running_cluster(default_gguf, tmp_path / "logs", model=MODEL, batch_invariant=True,
                         coordinator_args=("--heartbeat-misses", "30")) as cluster:
        miss = ask(cluster, question)
        hit = ask(cluster, question)
        others = ("Name three rivers.", "What is 12 times 7?", "Write a haiku about the sea.")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            side = [pool.submit(ask, cluster, q) for q in others]
            beside = pool.submit(ask, cluster, question).result()
            assert all(f.result()[0] for f in side)
        assert len(miss[1]) == 32
        assert hit == miss
        assert beside == miss
        workers = cluster.wait_pools_full()
        assert all(w["num_free_blocks"] == w["num_blocks"] for w in workers)
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "blocks cached there" in log and "prefill local" not in log  # the hit went remote too
