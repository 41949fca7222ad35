"""`n` > 1 and prompt lists, with the real `openai` client against a running tandem: n choices
indexed in order, streamed chunks carrying their index, usage summed, the n choices of a prompt
on one decode worker, and the bounds as 400s naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from coordinator import openai_api as oa
from coordinator.ollama_request import RequestError
from tests.helpers.api_cluster import MODEL, api  # noqa: F401 (fixture)

MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def test_n_greedy_chat_choices_equal_the_single_answer(oai):
    one = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                      max_tokens=8)
    three = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                        max_tokens=8, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in three.choices)
    assert all(c.finish_reason == one.choices[0].finish_reason for c in three.choices)
    # The prompt counts once, every choice's tokens are summed (as OpenAI counts n).
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_n_seeded_samples_differ_and_repeat(oai):
    def ask():
        r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.5,
                                        max_tokens=12, n=3, seed=7)
        return [c.message.content for c in r.choices]

    first, again = ask(), ask()
    assert first == again  # choice i is seeded seed + i
    assert len(set(first)) > 1


def test_n_streamed_chunks_carry_their_index(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                        max_tokens=8, n=2)
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                         max_tokens=8, n=2, stream=True,
                                         stream_options={"include_usage": True})
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_prompt_lists_as_lm_eval_batches_them(oai, api):
    prompts = ["The sky is", "Rivers flow to", "One two three"]
    singles = [oai.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5)
               for p in prompts]
    batch = oai.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # Token lists, and a list of them, are the same prompts.
    tokens = httpx.post(api.url + "/tokenize", json={"model": MODEL, "prompt": prompts[1]},
                        timeout=10).json()["tokens"]
    as_ids = oai.completions.create(model=MODEL, prompt=tokens, temperature=0, max_tokens=5)
    lists = oai.completions.create(model=MODEL, prompt=[tokens, tokens], temperature=0,
                                   max_tokens=5)
    assert as_ids.choices[0].text == singles[1].choices[0].text
    assert [c.text for c in lists.choices] == [singles[1].choices[0].text] * 2


def test_prompt_lists_times_n_are_indexed_prompt_by_prompt_and_stream(oai):
    prompts = ["The sky is", "Rivers flow to"]
    whole = oai.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0,
                                   max_tokens=4)
    texts = [c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    streamed = {i: "" for i in range(4)}
    for chunk in oai.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0,
                                        max_tokens=4, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == texts


def test_echo_applies_to_each_prompt(oai):
    prompts = ["The sky is", "Rivers flow to"]
    r = oai.completions.create(model=MODEL, prompt=prompts, echo=True, temperature=0,
                               max_tokens=3)
    assert [c.text[:len(p)] for c, p in zip(r.choices, prompts)] == prompts


def test_each_choice_is_a_request_of_its_own(api):
    # The coordinator logs one line per request, naming its decode worker.
    before = api.coordinator_log().count("decode decode-0")
    r = httpx.post(api.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "n": 4, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    deadline = time.monotonic() + 10
    while api.coordinator_log().count("decode decode-0") < before + 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.coordinator_log().count("decode decode-0") == before + 4


@pytest.mark.parametrize("body, message", [
    ({"n": 17}, "n must be an integer between 1 and 16, got 17"),
    ({"n": 0}, "n must be an integer between 1 and 16, got 0"),
    ({"n": True}, "n must be an integer between 1 and 16, got true"),
    ({"n": "2"}, 'n must be an integer between 1 and 16, got "2"'),
    ({"prompt": []}, "prompt must be a non-empty string"),
    ({"prompt": ["ok", ""]}, "prompt[1] must be a non-empty string"),
    ({"prompt": ["ok", [1, "x"]]}, "prompt[1] must be a non-empty string"),
    ({"prompt": ["ok", [True]]}, "prompt[1] must be a non-empty string"),
    ({"prompt": ["p"] * 17, "n": 4}, "prompt has 17 prompts and n is 4: at most 64 choices"),
])
def test_bounds_are_400s_naming_the_field(body, message):
    with pytest.raises(RequestError) as info:
        oa.parse_completion({"model": MODEL, "prompt": "x", **body})
    assert message in str(info.value)


def test_bounds_reach_the_client_as_400s(oai, api):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt=["a"] * 65, max_tokens=1)
    assert "at most 64 choices per request" in info.value.message
    r = httpx.post(api.url + "/v1/chat/completions", timeout=10,
                   content=json.dumps({"model": MODEL, "messages": MESSAGES, "n": 99}))
    assert r.status_code == 400 and "n must be an integer" in r.json()["error"]["message"]


# ---- placement and cancellation of the choices, on fake workers ------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.helpers.coordinator_fakes import load_model, make_tiny_model_dir

    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_the_choices_of_a_prompt_share_one_decode_worker_of_two(tiny):
    from tests.helpers.coordinator_fakes import DEADLINE_S, Script, coordinator_harness, run

    async def scenario():
        async with coordinator_harness(tiny) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            script = Script(tokens=[5, 6, 7, 8], finish_reason="length", token_delay_s=0.05)
            workers = [await h.add_worker(name, "decode", script) for name in ("d1", "d2")]
            answer = await client.post(f"{h.url}/v1/chat/completions", json={
                "model": "tiny", "messages": MESSAGES, "n": 6, "max_tokens": 4})
            # Two prompts of one request: each prompt's choices stay together.
            batch = await client.post(f"{h.url}/v1/completions", json={
                "model": "tiny", "prompt": ["a b c", "d e f"], "n": 3, "max_tokens": 4})
            return answer, batch, workers

    answer, batch, (d1, d2) = run(scenario())
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == list(range(6))
    assert batch.status_code == 200, batch.text
    chat_counts = sorted([len(d1.requests), len(d2.requests)])
    assert chat_counts[1] >= 6  # all six chat choices on one worker
    by_prompt: dict[tuple, set[str]] = {}
    for w in (d1, d2):
        for r in w.requests:
            by_prompt.setdefault(tuple(r.prompt_token_ids), set()).add(w.worker_id)
    assert len(by_prompt) == 3 and all(len(ws) == 1 for ws in by_prompt.values())


def test_a_client_that_leaves_cancels_every_choice(tiny):
    import asyncio

    from tests.helpers.coordinator_fakes import (
        DEADLINE_S, Script, coordinator_harness, run, wait_until,
    )

    async def scenario():
        async with coordinator_harness(tiny) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            worker = await h.add_worker("d1", "decode", Script(tokens=[5, 6, 7, 8, 9] * 20,
                                                               token_delay_s=0.05))
            async with client.stream("POST", f"{h.url}/v1/chat/completions", json={
                    "model": "tiny", "messages": MESSAGES, "n": 3, "stream": True}) as r:
                seen = set()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        # A choice's content (not its role chunk): it reached the worker.
                        seen |= {c["index"] for c in json.loads(line[6:])["choices"]
                                 if c["delta"].get("content")}
                    if len(seen) == 3:
                        break
            await wait_until(lambda: len(worker.cancelled) == 3, "every choice cancelled")
            await asyncio.sleep(0)
            return worker, seen

    worker, seen = run(scenario())
    assert seen == {0, 1, 2}
    assert len(worker.cancelled) == 3 and worker.finished == []


def _prefix_hits(api) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(api.url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:prefix_cache_hits_total")


def test_later_choices_find_the_prompt_in_the_prefix_cache(oai, api):
    # A prompt no earlier test sent, long enough for whole KV blocks and a remote prefill.
    words = " ".join(f"w{i}q{time.monotonic_ns() % 997}" for i in range(60))
    before = _prefix_hits(api)
    oai.completions.create(model=MODEL, prompt=words, temperature=0, max_tokens=2)
    alone = _prefix_hits(api) - before  # the first time: nothing cached
    other = " ".join(f"v{i}q{time.monotonic_ns() % 991}" for i in range(60))
    before = _prefix_hits(api)
    oai.completions.create(model=MODEL, prompt=other, temperature=0, max_tokens=2, n=4)
    shared = _prefix_hits(api) - before
    assert alone == 0
    assert shared > 0  # choices 1..3 found the blocks choice 0 computed
    print(f"prefix-cache hits: n=1 {alone:g} tokens, n=4 {shared:g} tokens")
