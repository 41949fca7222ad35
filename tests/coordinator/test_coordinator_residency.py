"""keep_alive (coordinator/residency.py) against fake workers: the model is unloaded from every
worker when the expiry passes with nothing in flight, and loaded on all of them before the
next request, whose load_duration is that wait."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from coordinator.residency import KeepAliveError, parse_keep_alive
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode("Hello world!", add_special_tokens=False)


def test_parse_keep_alive():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("300ms") == pytest.approx(0.3) and parse_keep_alive(2.5) == 2.5
    assert parse_keep_alive(0) == parse_keep_alive("0") == parse_keep_alive("0s") == 0
    assert parse_keep_alive(-1) == parse_keep_alive("-1m") == math.inf
    for bad in ("5x", "m", True, [], "1m5"):
        with pytest.raises(KeepAliveError):
            parse_keep_alive(bad)


async def chat(client, url, **body) -> httpx.Response:
    return await client.post(f"{url}/api/chat", json={"model": "tiny", "messages": MESSAGES,
                                                        "stream": False, **body})


async def ps(client, url) -> list[dict]:
    return (await client.get(f"{url}/api/ps")).json()["models"]


def test_keep_alive_0_unloads_every_worker_and_the_next_request_reloads(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            decode.load_delay_s = prefill.load_delay_s = 0.2
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                first = await chat(client, h.url, keep_alive=0)
                assert first.status_code == 200 and first.json()["load_duration"] == 0
                await wait_until(lambda: not h.coordinator.residency.resident
                                 and not decode.resident and not prefill.resident, "the unload")
                assert decode.residency_calls == prefill.residency_calls == [False]
                assert await ps(client, h.url) == []
                await wait_until(lambda: not h.coordinator.registry.get("d1").resident,
                                 "a heartbeat saying unloaded")
                # Loaded on both workers before the dispatch (the fakes refuse work unloaded).
                second = await chat(client, h.url, keep_alive="5m")
                assert second.status_code == 200, second.text
                assert second.json()["load_duration"] >= 0.2e9
                assert decode.residency_calls == prefill.residency_calls == [False, True]
                (entry,) = await ps(client, h.url)
                assert entry["expires_at"] != "2318-01-01T00:00:00Z"
                # Within keep_alive: nothing to load.
                third = await chat(client, h.url)
                assert third.status_code == 200 and third.json()["load_duration"] == 0
                assert decode.residency_calls == [False, True]
                assert third.json()["message"]["content"] == "Hello world!"

    run(scenario())


def test_explicit_unload_and_load_with_no_messages(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                r = await client.post(f"{h.url}/api/generate",
                                      json={"model": "tiny", "prompt": "", "keep_alive": 0})
                assert r.json()["done_reason"] == "unload"
                # Done by the time the answer came.
                assert decode.residency_calls == [False] and not decode.resident
                assert await ps(client, h.url) == []
                r = await client.post(f"{h.url}/api/chat",
                                      json={"model": "tiny", "messages": [], "keep_alive": -1})
                assert r.json()["done_reason"] == "load"
                assert decode.residency_calls == [False, True] and decode.resident
                (entry,) = await ps(client, h.url)
                assert entry["expires_at"] == "2318-01-01T00:00:00Z"  # forever
                bad = await chat(client, h.url, keep_alive="soon")
                assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]

    run(scenario())


def test_expiry_waits_for_the_requests_in_flight(model, tokens):
    async def scenario():
        async with coordinator_harness(model, keep_alive_s=math.inf) as h:
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens, token_delay_s=0.1))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                slow = asyncio.create_task(chat(client, h.url, keep_alive="300ms"))
                await wait_until(lambda: decode.requests, "the slow request to start")
                decode.script = Script(tokens=tokens[:1])
                fast = await chat(client, h.url, keep_alive=0)
                assert fast.status_code == 200
                await asyncio.sleep(0.2)
                assert decode.residency_calls == []  # the slow one is still running
                assert (await slow).status_code == 200
                await wait_until(lambda: decode.residency_calls == [False], "the expiry")
                assert await ps(client, h.url) == []

    run(scenario())


def test_default_keep_alive_from_the_config_expires(model, tokens):
    async def scenario():
        async with coordinator_harness(model, keep_alive_s=0.3) as h:
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                assert (await chat(client, h.url)).status_code == 200
                (entry,) = await ps(client, h.url)
                assert entry["expires_at"].endswith("Z")
                await wait_until(lambda: decode.residency_calls == [False], "the default expiry")

    run(scenario())
