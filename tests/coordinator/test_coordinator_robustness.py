"""Issue 15 on the coordinator: its event loop never blocks on a huge prompt, its own stall is
not blamed on the workers, and it neither spams its log nor leaks what clients need not see."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import httpx
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.http_api import create_app
from coordinator.registry import WorkerRegistry
from coordinator.service import Coordinator
from common.rpc import worker_pb2 as pb
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

# Heartbeats every 0.1 s and dead after 3 misses: a loop stalled for 0.3 s would kill workers.
# Heartbeats every 0.1 s; a worker silent for 1 s of responsive loop is dead. (3 misses, 0.3 s,
# had a live worker declared dead on a host slowed several-fold, with the suite's own load.)
TIGHT = dict(heartbeat_interval_s=0.1, heartbeat_misses=10)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A context so long that a 2 MB prompt passes the byte check and is really tokenized."""
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("long"), max_position=400_000))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode("Hello world!", add_special_tokens=False)


async def _poll_version(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /api/version every 20 ms; `latencies`: the time from one answer to the next, less
    the pause (the client shares the server's loop, so a stall shows as a gap)."""
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        last = time.monotonic()
        while not stop.is_set():
            r = await client.get(f"{url}/api/version")
            assert r.status_code == 200
            now = time.monotonic()
            latencies.append(now - last)
            last = now + 0.02
            await asyncio.sleep(0.02)


async def _huge_prompt_while_polling(model, tokens, path: str, body: dict,
                                     latencies: list[float] | None = None):
    async with coordinator_harness(model, **TIGHT) as h:
        await h.add_worker("d1", "decode", Script(tokens=tokens))
        await h.add_worker("p1", "prefill", Script(tokens=tokens))
        stop = asyncio.Event()
        latencies = [] if latencies is None else latencies
        poller = asyncio.create_task(_poll_version(h.url, stop, latencies))
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            start = time.monotonic()
            r = await client.post(f"{h.url}{path}", json=body)
            elapsed = time.monotonic() - start
        await asyncio.sleep(0.5)  # heartbeats that a stall would have missed
        stop.set()
        await poller
        dead = [w.worker_id for w in h.coordinator.registry.all() if not w.alive]
        return r, elapsed, latencies, dead


class _RecordingTokenizer:
    """The model's tokenizer, recording each encode of a long text: the thread it ran on and
    how many /api/version answers arrived while it ran."""

    def __init__(self, tokenizer, answers: list[float]) -> None:
        self._tokenizer, self._answers = tokenizer, answers
        self.encodes: list[tuple[str, int]] = []  # (thread name, answers during the encode)

    def encode(self, text, *args, **kwargs):
        if len(text) < 10_000:
            return self._tokenizer.encode(text, *args, **kwargs)
        before = len(self._answers)
        try:
            return self._tokenizer.encode(text, *args, **kwargs)
        finally:
            self.encodes.append((threading.current_thread().name, len(self._answers) - before))

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("raw", [False, True])
def test_4mb_prompt_is_refused_before_tokenizing_while_the_loop_keeps_serving(model, tokens, raw):
    """Refused by its byte length alone: the tokenizer never sees it, the loop answers on."""
    latencies: list[float] = []
    recorder = _RecordingTokenizer(model.tokenizer, latencies)
    model = dataclasses.replace(model, tokenizer=recorder)
    prompt = "the river and the city " * (4_000_000 // 23)
    r, _, latencies, dead = run(_huge_prompt_while_polling(
        model, tokens, "/api/generate",
        {"model": "tiny", "prompt": prompt, "raw": raw, "stream": False}, latencies))
    assert r.status_code == 400, r.text[:300]
    assert "context window" in r.json()["error"] and len(r.text) < 1000
    assert recorder.encodes == []  # refused before any tokenizing
    assert latencies and dead == []


def test_prompt_tokenized_off_the_loop_does_not_stall_it(long_model):
    """2 MB under the byte bound: tokenized for real (seconds of CPU), on the tokenizing
    threads without the GIL, while /api/version and the heartbeats go on: the loop answered
    while the encode ran, which a tokenizer on the loop's own thread would have prevented."""
    latencies: list[float] = []
    recorder = _RecordingTokenizer(long_model.tokenizer, latencies)
    long_model = dataclasses.replace(long_model, tokenizer=recorder)
    ids = recorder.encode("Hello world!", add_special_tokens=False)
    prompt = "the river and the city " * (2_000_000 // 23)
    r, _, polled, dead = run(_huge_prompt_while_polling(
        long_model, ids, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1},
        latencies))
    assert r.status_code == 400, r.text[:300]  # tokenized: more tokens than the context
    assert "tokens" in r.json()["error"]["message"]
    assert recorder.encodes and all(name.startswith("tandem-tokenize") for name, _ in recorder.encodes)
    assert any(answered > 0 for _, answered in recorder.encodes), recorder.encodes
    assert dead == []


def test_a_stalled_coordinator_does_not_declare_its_workers_dead(model, tokens):
    async def scenario():
        async with coordinator_harness(model, **TIGHT) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            await asyncio.sleep(0.3)
            time.sleep(2.5)  # the loop itself is blocked: 25 heartbeat intervals, 2.5x a death
            alive_right_after = h.coordinator.registry.get("d1").alive
            await asyncio.sleep(0.5)
            return alive_right_after, h.coordinator.registry.get("d1"), h.coordinator.registry

    alive_right_after, record, registry = run(scenario())
    assert alive_right_after and record.alive and record.registrations == 1
    assert registry.stalled_s > 2.0


def test_silence_counts_only_while_the_coordinator_was_responsive():
    now = [0.0]
    registry = WorkerRegistry(CoordinatorConfig(heartbeat_interval_s=1.0, heartbeat_misses=3),
                              "fp", clock=lambda: now[0])

    async def scenario():
        registry.tick()
        assert registry.register(pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                                               model_fingerprint="fp")).accepted
        now[0] = 60.0  # the loop stalled for a minute: no tick, no heartbeat read
        assert [r.worker_id for r in registry.live()] == ["w"]  # before the next tick, too
        registry.tick()
        assert registry.stalled_s == pytest.approx(58.5)
        # Of the stall, one tick gap (1.5 s) counts as silence, as if the loop had run.
        assert [r.worker_id for r in registry.live()] == ["w"]
        for _ in range(2):  # then 1 s more, ticking every half interval: 2.5 s in all
            now[0] += 0.5
            registry.tick()
        assert [r.worker_id for r in registry.live()] == ["w"]
        for _ in range(2):  # 3.5 s of silence: dead
            now[0] += 0.5
            registry.tick()
        assert registry.live() == []
        assert "no heartbeat" in registry.get("w").dead_reason
        await registry.close()

    asyncio.run(scenario())


# ---- log spam and leaks -------------------------------------------------------------------------

def test_half_a_body_then_disconnect_is_one_info_line_without_traceback(model, caplog):
    async def scenario():
        async with coordinator_harness(model) as h:
            port = int(h.url.rsplit(":", 1)[1])
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /api/chat HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.close()
                await writer.wait_closed()
            await wait_until(lambda: sum("left before sending" in r.getMessage()
                                         for r in caplog.records) >= 3, "3 disconnect lines")
            await asyncio.sleep(0.2)

    with caplog.at_level(logging.INFO):
        run(scenario())
    left = [r for r in caplog.records if "left before sending" in r.getMessage()]
    assert len(left) == 3 and all(r.levelno == logging.INFO and not r.exc_info for r in left)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_show_by_absolute_path_does_not_answer_with_the_path(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await client.post(f"{h.url}/api/show", json={"model": str(model.path)})

    r = run(scenario())
    assert r.status_code == 200
    assert str(model.path) not in r.text and str(model.path.parent) not in r.text
    assert r.json()["modelfile"].splitlines()[1] == "FROM tiny:latest"
    assert model.fingerprint not in r.text


@pytest.mark.parametrize("path,body", [
    ("/api/show", {}),
    ("/api/generate", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_4mb_model_name_is_not_echoed_whole(model, path, body):
    name = "m" * 4_000_000

    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await client.post(f"{h.url}{path}", json={"model": name, **body})

    r = run(scenario())
    assert r.status_code == 404
    assert len(r.text) < 300 and "m" * 100 + "..." in r.text


def _workers_status(model, client: tuple[str, int], **config) -> httpx.Response:
    app = create_app(Coordinator(CoordinatorConfig(**config), model))

    async def scenario():
        transport = httpx.ASGITransport(app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://10.1.1.1") as c:
            return await c.get("/internal/workers")

    return asyncio.run(scenario())


def test_internal_workers_only_for_this_host_or_named_networks(model):
    assert _workers_status(model, ("127.0.0.1", 5000)).status_code == 200
    assert _workers_status(model, ("::1", 5000)).status_code == 200
    assert _workers_status(model, ("10.1.1.1", 5000)).status_code == 200  # this host's address
    refused = _workers_status(model, ("203.0.113.9", 5000))
    assert refused.status_code == 403 and model.fingerprint not in refused.text
    assert "error" in refused.json()
    allowed = _workers_status(model, ("203.0.113.9", 5000), internal_api_from=("203.0.113.0/24",))
    assert allowed.status_code == 200 and allowed.json()["model_fingerprint"] == model.fingerprint


def test_internal_api_from_must_be_networks():
    with pytest.raises(ValueError, match="internal_api_from"):
        CoordinatorConfig(internal_api_from=("not-a-network",))
