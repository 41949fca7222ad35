"""The endpoints that probes and vLLM-minded tools call: /health, /version, /tokenize and
/detokenize, on the real coordinator with fake workers."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run,
)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_health_needs_a_worker_that_decodes(model):
    async def scenario():
        answers = []
        async with coordinator_harness(model) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            answers.append(await client.get(f"{h.url}/health"))
            await h.add_worker("p1", "prefill", Script())
            answers.append(await client.get(f"{h.url}/health"))
            await h.add_worker("d1", "decode", Script())
            answers.append(await client.get(f"{h.url}/health"))
            version = await client.get(f"{h.url}/version")
        return answers, version

    (none, prefill_only, ready), version = run(scenario())
    assert none.status_code == 503 and none.json()["status"] == "unavailable"
    assert "no live decode or colocated worker serves tiny" in none.json()["reason"]
    assert prefill_only.status_code == 503
    assert "1 prefill worker(s) live" in prefill_only.json()["reason"]
    assert prefill_only.json()["live_workers"]["prefill"] == 1
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    assert ready.json()["model"] == "tiny"
    assert version.status_code == 200 and isinstance(version.json()["version"], str)


def test_tokenize_and_detokenize_in_vllms_shapes(model):
    tok = model.tokenizer

    async def scenario():
        async with coordinator_harness(model) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            async def post(path, **body):
                return await client.post(f"{h.url}{path}", json={"model": "tiny", **body})
            return [
                await post("/tokenize", prompt="Hello world"),
                await post("/tokenize", prompt="Hello world", add_special_tokens=False,
                           return_token_strs=True),
                await post("/tokenize", messages=MESSAGES),
                await post("/detokenize", tokens=tok.encode("Hello world", False)),
                await post("/tokenize", prompt="x", messages=MESSAGES),
                await post("/detokenize", tokens=[10 ** 9]),
                await post("/detokenize", tokens=[True]),
                await client.post(f"{h.url}/tokenize", json={"model": "other", "prompt": "x"}),
            ]

    plain, bare, chat, text, both, outside, boolean, other = run(scenario())
    assert plain.status_code == 200, plain.text
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert plain.json() == {"tokens": ids, "count": len(ids), "max_model_len": model.context_len,
                            "token_strs": None}
    bare_ids = tok.encode("Hello world", add_special_tokens=False)
    assert bare.json()["tokens"] == bare_ids
    assert bare.json()["token_strs"] == [tok.id_to_token(i) for i in bare_ids]
    # Messages count as /v1/chat/completions would prefill them.
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat.json()["tokens"] == tok.encode(rendered)
    assert chat.json()["count"] == len(tok.encode(rendered))
    assert text.status_code == 200 and text.json() == {"prompt": "Hello world"}
    for bad in (both, outside, boolean):
        assert bad.status_code == 400, bad.text
        assert isinstance(bad.json()["error"]["message"], str)  # OpenAI's shape, as vLLM
    assert other.status_code == 404
