"""Ollama's `think` (coordinator/thinking.py): a template that can think is rendered with
enable_thinking, its answer's <think> block comes back as message.thinking (/api/chat) or
`thinking` (/api/generate), streamed or not, and OpenAI's reasoning_effort does the same with
vLLM's reasoning_content; a template that cannot think answers think: true with Ollama's 400."""

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


def test_think_on_generate_splits_the_response_streamed_or_not(thinker, plain):
    tokens = thinker.tokenizer.encode(ANSWER, add_special_tokens=False)

    def generate(url: str, client: httpx.AsyncClient, **body):
        return client.post(f"{url}/api/generate", json={"model": "tiny", "prompt": "Hi", **body})

    async def scenario():
        async with coordinator_harness(thinker) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                whole = (await generate(h.url, client, stream=False, think="high")).json()
                async with client.stream("POST", f"{h.url}/api/generate", json={
                        "model": "tiny", "prompt": "Hi", "think": True}) as r:
                    lines = [json.loads(line) async for line in r.aiter_lines()]
                off = (await generate(h.url, client, stream=False, think=False)).json()
        async with coordinator_harness(plain) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                refused = await generate(h.url, client, stream=False, think=True)
                plain_off = (await generate(h.url, client, stream=False, think=False)).json()
        return d1, whole, lines, off, refused, plain_off

    d1, whole, lines, off, refused, plain_off = asyncio.run(scenario())
    assert (whole["thinking"], whole["response"]) == ("The user greets me.\n", "Hello there!")
    assert "".join(x.get("thinking", "") for x in lines) == "The user greets me.\n"
    assert "".join(x["response"] for x in lines) == "Hello there!" and lines[-1]["done"]
    assert not any("<think>" in x["response"] or "</think>" in x["response"] for x in lines)
    # The context continues from the whole output, the block included.
    assert thinker.tokenizer.decode(whole["context"]).endswith(ANSWER)
    prompts = [thinker.tokenizer.decode(list(r.prompt_token_ids)) for r in d1.requests]
    assert "</think>" not in prompts[0] and prompts[2].rstrip().endswith("<think>\n\n</think>")
    assert "thinking" not in off and off["response"] == ANSWER
    assert refused.status_code == 400 and refused.json()["error"] == '"tiny" does not support thinking'
    assert "thinking" not in plain_off and plain_off["response"] == ANSWER


def test_reasoning_effort_is_think_with_reasoning_content(thinker, plain):
    import openai

    tokens = thinker.tokenizer.encode(ANSWER, add_special_tokens=False)

    async def scenario():
        out = {}
        async with coordinator_harness(thinker) as h:
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x",
                                          max_retries=0) as oai:
                done = await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         reasoning_effort="low")
                out["whole"] = done.choices[0].message.model_dump()
                stream = await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                           reasoning_effort="medium", stream=True)
                out["deltas"] = [c.choices[0].delta.model_dump() async for c in stream
                                 if c.choices]
                done = await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         reasoning_effort="minimal")
                out["off"] = done.choices[0].message.model_dump()
                try:
                    await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                      extra_body={"reasoning_effort": "max"})
                except openai.BadRequestError as exc:
                    out["bad"] = exc.message
                try:
                    await oai.completions.create(model="tiny", prompt="Hi",
                                                 extra_body={"reasoning_effort": "high"})
                except openai.BadRequestError as exc:
                    out["completions"] = exc.message
            out["prompts"] = [thinker.tokenizer.decode(list(r.prompt_token_ids))
                              for r in d1.requests]
        async with coordinator_harness(plain) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x",
                                          max_retries=0) as oai:
                done = await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         reasoning_effort="none")
                out["plain_none"] = done.choices[0].message.content
                try:
                    await oai.chat.completions.create(model="tiny", messages=MESSAGES,
                                                      reasoning_effort="high")
                except openai.BadRequestError as exc:
                    out["plain_high"] = exc.message
        return out

    out = asyncio.run(scenario())
    assert out["whole"]["content"] == "Hello there!"
    assert out["whole"]["reasoning_content"] == "The user greets me.\n"
    reasoning = "".join(d.get("reasoning_content") or "" for d in out["deltas"])
    content = "".join(d.get("content") or "" for d in out["deltas"])
    assert (reasoning, content) == ("The user greets me.\n", "Hello there!")
    # Low and medium reach the template as Ollama's levels do; minimal turns thinking off.
    assert "</think>" not in out["prompts"][0] and "</think>" not in out["prompts"][1]
    assert out["prompts"][2].rstrip().endswith("<think>\n\n</think>")
    assert out["off"]["content"] == ANSWER and out["off"].get("reasoning_content") is None
    assert "reasoning_effort must be one of" in out["bad"]
    assert "reasoning is served on /v1/chat/completions" in out["completions"]
    assert out["plain_none"] == ANSWER
    assert "does not support thinking" in out["plain_high"]
