"""`--response-cache semantic:model=NAME,threshold=T`: the turns embedded by an embedding model
served beside the chat model, through a real cluster of two tiny random models: a llama chat
model, and a qwen3 "embedder" GGUF laid out as Qwen3-Embedding's is (`qwen3.pooling_type`
last, `tokenizer.ggml.add_eos_token`: its vector is the last position's, at an EOS the
tokenizer appends). Every decision the cache makes
must be the one the embedder's cosines predict (/api/embed of the embedder: each turn as
written, its own pooling), and for some turn the chat model's own embedding (EMBED_TEMPLATE,
last position) would have decided otherwise, so the test tells which model embedded."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from coordinator.response_cache import EMBED_TEMPLATE
from coordinator.turn_terms import TurnTerms
from common.tokenizer import Tokenizer
from coordinator.client import TandemClient
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_gguf, make_tiny_hf_model
from tests.helpers.cluster import running_cluster

FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
THRESHOLD = 0.99
EDGE = 0.002  # a cosine this near the threshold is too close to call across hosts' float math
EMBEDDER_METADATA = {"qwen3.pooling_type": 3, "tokenizer.ggml.add_eos_token": True}  # 3: last
# Questions asked again with the same words (case, punctuation, contractions): the word rules
# let each pair through, so the cosine decides.
ASKED = {
    "What is the capital of France?": ("what is the capital of France", "What's the capital of France?",
                                       "what is the capital of France..."),
    "How many legs does a spider have?": ("how many legs does a spider have",
                                          "How many legs does a spider have??"),
}


def embed(url: str, model: str, texts: list[str],
          pooling: str | None = None) -> tuple[np.ndarray, int]:
    """Unit vectors and prompt_eval_count."""
    body = {"model": model, "input": texts} | ({"pooling": pooling} if pooling else {})
    r = httpx.post(url + "/api/embed", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float64), r.json()["prompt_eval_count"]


def ask(url: str, text: str) -> str:
    r = httpx.post(url + "/api/chat", timeout=120, json={
        "model": "chat", "stream": False, "options": {"temperature": 0, "num_predict": 2},
        "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.headers["X-Tandem-Cache"]


def metric(url: str, series: str) -> float:
    """One series' value on /metrics, e.g. 'name{kind="semantic"}'."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(series)} ([0-9.e+-]+)$", text, re.M)
    assert found, series
    return float(found.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedder")
    chat = make_tiny_hf_model(root / "chat", "llama", seed=0)
    embedder = root / "emb.gguf"
    make_tiny_gguf(embedder, "F32", "qwen3", seed=1, metadata=EMBEDDER_METADATA)
    grpc_port = free_port()
    with running_cluster(chat, root / "logs", model="chat", worker_args=FP32,
                         more_models=(("emb", embedder),),
                         coordinator_args=("--response-cache",
                                           f"semantic:model=emb,threshold={THRESHOLD}",
                                           "--grpc-port", str(grpc_port))) as c:
        yield c.url, Tokenizer.from_path(embedder), grpc_port


def test_the_embedding_model_decides_every_semantic_hit(served):
    url, tokenizer, grpc_port = served
    expected, outcomes, differs = [], [], 0
    for base, again in ASKED.items():
        texts = [base, *again]
        own, count = embed(url, "emb", texts)  # the embedder's own pooling, as the cache asks
        # one EOS more per text than its words' tokens (the GGUF's add_eos_token; no BOS)
        assert count == sum(len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in texts)
        chat, _ = embed(url, "chat", [EMBED_TEMPLATE.format(t) for t in texts], "last")
        assert ask(url, base) == "miss"
        stored = [0]  # indices of the turns in the cache's index: every miss is stored
        for i in range(1, len(texts)):
            assert TurnTerms.of(texts[i]).same_question(TurnTerms.of(base))
            score = max(float(own[i] @ own[j]) for j in stored)
            by_chat = max(float(chat[i] @ chat[j]) for j in stored)
            got = ask(url, texts[i])
            outcomes.append((texts[i], score, by_chat, got))
            if abs(score - THRESHOLD) > EDGE:
                want = "hit" if score >= THRESHOLD else "miss"
                assert got == want, outcomes
                expected.append(want)
                differs += (by_chat >= THRESHOLD) != (score >= THRESHOLD) and abs(by_chat - THRESHOLD) > EDGE
            if got == "miss":
                stored.append(i)
    print("\n".join(f"{o[3]:4} embedder {o[1]:.4f} chat model {o[2]:.4f}  {o[0]}" for o in outcomes))
    # Else the models' cosines fell where this test cannot tell them apart: it proves nothing.
    assert "hit" in expected and "miss" in expected and differs, outcomes
    assert metric(url, "tandem_response_cache_embed_failures_total") == 0
    assert metric(url, 'tandem_response_cache_hits_total{kind="semantic"}') == sum(
        o[3] == "hit" for o in outcomes)
    # gRPC's Chat looks its last user turn up in the same index (the same prompt and options)
    semantic = metric(url, 'tandem_response_cache_hits_total{kind="semantic"}')
    with TandemClient(f"127.0.0.1:{grpc_port}") as client:
        for text, _, _, got in outcomes:
            replies = list(client.chat("chat", [{"role": "user", "content": text}],
                                       options={"temperature": 0, "num_predict": 2}))
            # a miss was stored: asked again, it is an exact hit; a hit is a semantic one again
            assert replies[-1].figures.cache == "hit", text
    assert metric(url, 'tandem_response_cache_hits_total{kind="semantic"}') == semantic + sum(
        o[3] == "hit" for o in outcomes)


def test_an_exact_repeat_is_a_hit_without_the_embedder(served):
    url = served[0]
    assert ask(url, "Name a colour of the sea.") == "miss"
    assert ask(url, "Name a colour of the sea.") == "hit"
