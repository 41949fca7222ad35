"""Ollama's `think` (coordinator/thinking.py): a template that can think is rendered with
enable_thinking, its answer's <think> block comes back as message.thinking, streamed or not;
a template that cannot think answers think: true with Ollama's 400."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from coordinator.thinking import ThinkSplitter, supports_thinking
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir,
)

# Qwen3's shape, cut down: thinking on unless enable_thinking is false, which writes an empty
# block into the prompt so that the model answers at once.
THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}")
ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello there!"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("thinker"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_model(path)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("plain")))


def _split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("text, started, want", [
    (ANSWER, False, ("The user greets me.\n", "Hello there!")),
    ("The plan.</think>\nDone", True, ("The plan.", "Done")),  # the prompt opened the block
    ("No block at all <think> inside", False, ("", "No block at all <think> inside")),
    ("  <think>cut short", False, ("cut short", "")),
    ("<thi", False, ("", "<thi")),  # an unfinished tag at the very end is text
])
def test_the_splitter_whatever_the_pieces(text, started, want):
    rng = random.Random(3)
    for _ in range(200):
        splitter = ThinkSplitter(started)
        parts = [splitter.push(p) for p in _split_randomly(text, rng)] + [splitter.finish()]
        assert ("".join(t for t, _ in parts), "".join(c for _, c in parts)) == want
        assert not any("<think>" in t or "</think>" in t for t, _ in parts)


def test_templates_that_think_are_recognized(thinker, plain):
    assert supports_thinking(thinker.tokenizer.chat_template)
    assert not supports_thinking(plain.tokenizer.chat_template)


def _chat(url: str, client: httpx.AsyncClient, **body):
    return client.post(f"{url}/api/chat", json={"model": "tiny", "messages": MESSAGES, **body})


def test_think_splits_the_answer_and_sets_the_template(thinker):
    tokens = thinker.tokenizer.encode(ANSWER, add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(thinker) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                whole = (await _chat(h.url, client, stream=False, think=True)).json()
                async with client.stream("POST", f"{h.url}/api/chat", json={
                        "model": "tiny", "messages": MESSAGES, "think": True}) as r:
                    lines = [json.loads(line) async for line in r.aiter_lines()]
                off = (await _chat(h.url, client, stream=False, think=False)).json()
                unset = (await _chat(h.url, client, stream=False)).json()
                bad = await _chat(h.url, client, stream=False, think="very")
            return d1, whole, lines, off, unset, bad

    d1, whole, lines, off, unset, bad = asyncio.run(scenario())
    assert whole["message"] == {"role": "assistant", "content": "Hello there!",
                                "thinking": "The user greets me.\n"}
    assert "".join(x["message"].get("thinking", "") for x in lines) == "The user greets me.\n"
    assert "".join(x["message"]["content"] for x in lines) == "Hello there!"
    assert lines[-1]["done"] is True
    prompts = [thinker.tokenizer.decode(list(r.prompt_token_ids)) for r in d1.requests]
    assert "</think>" not in prompts[0]  # think true: the model thinks
    assert prompts[2].rstrip().endswith("<think>\n\n</think>")  # think false: an empty block
    assert "thinking" not in off["message"] and "thinking" not in unset["message"]
    assert unset["message"]["content"] == ANSWER  # unset: as the model wrote it
    assert bad.status_code == 400 and "think must be" in bad.json()["error"]


def test_a_template_that_cannot_think_refuses_think_true(plain):
    tokens = plain.tokenizer.encode("Hello", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(plain) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return (await _chat(h.url, client, stream=False, think=True),
                        await _chat(h.url, client, stream=False, think=False))

    yes, no = asyncio.run(scenario())
    assert yes.status_code == 400 and yes.json()["error"] == '"tiny" does not support thinking'
    assert no.status_code == 200 and no.json()["message"]["content"] == "Hello"
