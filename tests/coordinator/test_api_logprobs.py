"""Logprobs on both APIs through the real `ollama` and `openai` clients, streamed and not, on
fake workers (tests/helpers/coordinator_fakes.py) that send scripted entries: the shapes, that each
token's entry arrives once and in order, that the first token's entry of a disaggregated request
comes from the prefill worker's PrefillResult, and that a request that asks for nothing gets
nothing (and asks the workers for nothing)."""

from __future__ import annotations

import ollama
import openai
import pytest

from common.logprobs import TokenLogprob
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run,
)

TEXT = "Hello world!"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def script(model):
    tokens = model.tokenizer.encode(TEXT, add_special_tokens=False)
    entries = [TokenLogprob(t, -0.25 * (i + 1), ((t, -0.25 * (i + 1)), (7, -3.5 - i)))
               for i, t in enumerate(tokens)]
    return Script(tokens=tokens, logprobs=entries)


def text_of(model, token_id: int) -> str:
    return model.tokenizer.decode([token_id], skip_special_tokens=False)


def check_entries(model, script, got, top: int) -> None:
    """`got`: Ollama's Logprob objects or OpenAI's ChatCompletionTokenLogprob, in order."""
    assert len(got) == len(script.tokens)
    for entry, want in zip(got, script.logprobs):
        assert entry.token == text_of(model, want.token_id)
        assert entry.logprob == pytest.approx(want.logprob)
        if hasattr(entry, "bytes"):
            assert entry.bytes == list(entry.token.encode())
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (text_of(model, i), pytest.approx(lp)) for i, lp in want.top[:top]]


async def disaggregated(h, script):
    prefill = await h.add_worker("p1", "prefill", script)
    decode = await h.add_worker("d1", "decode", script)
    return prefill, decode


def test_ollama_chat_and_generate_logprobs_with_a_remote_first_token(model, script):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill, decode = await disaggregated(h, script)
            client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S)
            whole = await client.chat(model="tiny", messages=MESSAGES, logprobs=True,
                                      top_logprobs=2)
            parts = [p async for p in await client.chat(model="tiny", messages=MESSAGES,
                                                        stream=True, logprobs=True,
                                                        top_logprobs=1)]
            gen = await client.generate(model="tiny", prompt="Hi", logprobs=True)
            plain = await client.generate(model="tiny", prompt="Hi")
            return prefill, decode, whole, parts, gen, plain

    prefill, decode, whole, parts, gen, plain = run(scenario())
    assert [r.sampling.logprobs for r in prefill.requests[:3]] == [2, 1, 0]
    assert [r.sampling.logprobs for r in decode.requests[:3]] == [2, 1, 0]
    check_entries(model, script, whole.logprobs, 2)
    assert "".join(e.token for e in whole.logprobs) == whole.message.content == TEXT
    streamed = [e for p in parts for e in (p.logprobs or [])]
    check_entries(model, script, streamed, 1)
    assert "".join(p.message.content for p in parts) == TEXT
    check_entries(model, script, gen.logprobs, 0)
    assert plain.logprobs is None
    assert not prefill.requests[3].sampling.HasField("logprobs")
    assert not decode.requests[3].sampling.HasField("logprobs")


def test_ollama_generate_stream_logprobs_on_a_colocated_worker(model, script):
    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("c1", "colocated", script)
            client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S)
            return [p async for p in await client.generate(model="tiny", prompt="Hi",
                                                           stream=True, logprobs=True,
                                                           top_logprobs=2)]

    parts = run(scenario())
    check_entries(model, script, [e for p in parts for e in (p.logprobs or [])], 2)
    assert "".join(p.response for p in parts) == TEXT


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S,
                              max_retries=0)


def test_openai_chat_logprobs_streamed_and_not(model, script):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h, oai(h.url) as client:
            await disaggregated(h, script)
            whole = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         logprobs=True, top_logprobs=2)
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                          logprobs=True, stream=True)
            chunks = [c async for c in stream]
            plain = await client.chat.completions.create(model="tiny", messages=MESSAGES)
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     top_logprobs=2)
            with pytest.raises(openai.BadRequestError) as too_many:
                await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     logprobs=True, top_logprobs=21)
            return whole, chunks, plain, bad.value, too_many.value

    whole, chunks, plain, bad, too_many = run(scenario())
    check_entries(model, script, whole.choices[0].logprobs.content, 2)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    check_entries(model, script, streamed, 0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert plain.choices[0].logprobs is None
    assert bad.status_code == 400 and "top_logprobs requires logprobs" in bad.message
    assert too_many.status_code == 400 and "top_logprobs must be" in too_many.message


def test_openai_completion_logprobs_streamed_and_not(model, script):
    async def scenario():
        async with coordinator_harness(model) as h, oai(h.url) as client:
            await h.add_worker("c1", "colocated", script)
            whole = await client.completions.create(model="tiny", prompt="Hi", logprobs=2)
            stream = await client.completions.create(model="tiny", prompt="Hi", logprobs=1,
                                                     stream=True)
            return whole, [c async for c in stream]

    whole, chunks = run(scenario())
    lp = whole.choices[0].logprobs
    texts = [text_of(model, t) for t in script.tokens]
    assert lp.tokens == texts and "".join(lp.tokens) == whole.choices[0].text == TEXT
    assert lp.token_logprobs == pytest.approx([e.logprob for e in script.logprobs])
    assert lp.top_logprobs == [{text_of(model, i): pytest.approx(v) for i, v in e.top}
                               for e in script.logprobs]
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    tokens, offsets, tops = [], [], []
    for c in chunks:
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
            tops += c.choices[0].logprobs.top_logprobs
    assert tokens == texts and offsets == lp.text_offset
    assert [list(t) for t in tops] == [[text_of(model, e.top[0][0])] for e in script.logprobs]


def check_prompt_part(model, prompt_ids, lp, top: int) -> None:
    """The echoed prompt's share of a completions logprobs object (the fakes' scripted
    prompt entries: token i's logprob -i / 10), the first token's logprob and top null."""
    n = len(prompt_ids)
    texts = [text_of(model, t) for t in prompt_ids]
    assert lp.tokens[:n] == texts
    assert lp.token_logprobs[:n] == [None] + [pytest.approx(-i / 10) for i in range(1, n)]
    assert lp.top_logprobs[0] is None
    assert [dict(t) for t in lp.top_logprobs[1:n]] == [
        {text_of(model, i): pytest.approx(v) for i, v in ((7, -5.0 - k), (8, -6.0))[:top]}
        for k in range(1, n)]
    assert lp.text_offset[:n] == [sum(len(t) for t in texts[:i]) for i in range(n)]


@pytest.mark.parametrize("role", ["colocated", "disaggregated"])
def test_openai_completion_echo_scores_the_prompt(model, script, role):
    """lm-eval-harness's loglikelihood call (echo, logprobs, max_tokens 0), and echo before a
    completion, streamed and not; the prompt entries come from the decode worker's first
    event (local prefill) or the prefill worker's PrefillResult."""
    prompt = "Hi there"
    prompt_ids = model.tokenizer.encode(prompt, add_special_tokens=True)

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h, oai(h.url) as client:
            if role == "colocated":
                workers = [await h.add_worker("c1", "colocated", script)]
            else:
                workers = list(await disaggregated(h, script))
            scored = await client.completions.create(model="tiny", prompt=prompt, echo=True,
                                                     logprobs=1, max_tokens=0)
            both = await client.completions.create(model="tiny", prompt=prompt, echo=True,
                                                   logprobs=2)
            stream = await client.completions.create(model="tiny", prompt=prompt, echo=True,
                                                     logprobs=0, max_tokens=0, stream=True)
            chunks = [c async for c in stream]
            text_only = await client.completions.create(model="tiny", prompt=prompt, echo=True)
            with pytest.raises(openai.BadRequestError) as zero:
                await client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
            with pytest.raises(openai.BadRequestError) as chat_echo:
                await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                     extra_body={"echo": True})
            return workers, scored, both, chunks, text_only, zero.value, chat_echo.value

    workers, scored, both, chunks, text_only, zero, chat_echo = run(scenario())
    n = len(prompt_ids)
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    assert len(choice.logprobs.tokens) == n
    check_prompt_part(model, prompt_ids, choice.logprobs, 1)
    # echo + completion: the prompt's entries, then the generated ones, offsets running on.
    choice = both.choices[0]
    assert choice.text == prompt + TEXT
    lp = choice.logprobs
    check_prompt_part(model, prompt_ids, lp, 2)
    assert lp.token_logprobs[n:] == pytest.approx([e.logprob for e in script.logprobs])
    texts = [text_of(model, t) for t in script.tokens]
    assert lp.tokens[n:] == texts
    assert lp.text_offset[n:] == [len(prompt) + sum(len(t) for t in texts[:i])
                                  for i in range(len(texts))]
    # Streamed scoring: one chunk with the prompt and its entries, then the finish.
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == prompt and parts[-1].finish_reason == "length"
    streamed = [p.logprobs for p in parts if p.logprobs is not None]
    assert len(streamed) == 1
    check_prompt_part(model, prompt_ids, streamed[0], 0)
    assert text_only.choices[0].text == prompt + TEXT and text_only.choices[0].logprobs is None
    # Each worker that prefilled was asked for prompt logprobs only when echo wanted them.
    asked = [r.sampling.prompt_logprobs if r.sampling.HasField("prompt_logprobs") else None
             for r in workers[0].requests]
    assert asked == [1, 2, 0, None]
    assert zero.status_code == 400 and "0 needs echo" in zero.message
    assert chat_echo.status_code == 400 and "echo" in chat_echo.message
