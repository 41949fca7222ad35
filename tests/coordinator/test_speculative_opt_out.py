"""The per-request speculation opt-out (`speculative: false`) from both client APIs to the
worker's SamplingOptions (fake worker, coordinator alone)."""

from __future__ import annotations

import httpx
import openai
import pytest

from coordinator.model import load_served_model
from tests.helpers.coordinator_fakes import Script, coordinator_harness, make_tiny_model_dir, run

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_served_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")), "tiny")


def test_speculative_false_reaches_the_worker_from_both_apis(model):
    tokens = model.tokenizer.encode("Hello", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=10_000) as h:
            worker = await h.add_worker("d1", "colocated", Script(tokens=tokens))
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x") as oai:
                await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                                  extra_body={"speculative": False})
                await oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
            async with httpx.AsyncClient(base_url=h.url) as raw:
                r = await raw.post("/api/chat", json={"model": "tiny", "messages": MESSAGES,
                                                      "stream": False,
                                                      "options": {"speculative": False}})
                assert r.status_code == 200, r.text
                bad = await raw.post("/api/chat", json={"model": "tiny", "messages": MESSAGES,
                                                        "stream": False,
                                                        "options": {"speculative": "no"}})
                assert bad.status_code == 400 and "speculative" in bad.text, bad.text
            return worker

    openai_off, openai_default, ollama_off = run(scenario()).requests
    assert openai_off.sampling.no_speculation and ollama_off.sampling.no_speculation
    assert not openai_default.sampling.no_speculation
