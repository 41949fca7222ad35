"""Prefix-aware routing and the KV metrics through the real coordinator (HTTP + Registry gRPC),
with fake workers that advertise cached block hashes and KV counters in their heartbeats."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.block_hash import block_hashes
from common.rpc import worker_pb2 as pb
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

TEXT = "Hello world! How are you?"
MESSAGES = [{"role": "user", "content": "Tell me a story about the river and the city."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


async def chat(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.post(f"{url}/api/chat", json={"model": "tiny", "messages": MESSAGES,
                                                   "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_goes_to_the_decode_worker_that_caches_its_prefix(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            await h.add_worker("p1", "prefill", Script(tokens=tokens))
            workers = {wid: await h.add_worker(wid, "decode",
                                               Script(tokens=tokens, kv_bytes_received=4096))
                       for wid in ("d1", "d2")}
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                first = await chat(client, h.url)
                # The worker that did not serve it now advertises the prompt's first blocks,
                # with a little more load than the other: the cache still wins.
                first_id = first["tandem"]["decode_worker"]
                holder = workers["d2" if first_id == "d1" else "d1"]
                prompt = list(workers[first_id].requests[0].prompt_token_ids)
                hashes = block_hashes(prompt[:-1], 16)
                assert len(hashes) >= 2
                holder.status.cached_block_hashes.extend(hashes)
                holder.status.num_free_blocks -= 2
                holder.status.num_running = 1
                record = h.coordinator.registry.get(holder.worker_id)
                await wait_until(lambda: len(record.load.cached_hashes) == len(hashes),
                                 "the hashes to arrive in a heartbeat")
                second = await chat(client, h.url)
                described = (await client.get(f"{h.url}/internal/workers")).json()
            return first, second, holder, hashes, described

    first, second, holder, hashes, described = run(scenario())
    assert second["tandem"]["decode_worker"] == holder.worker_id
    assert second["tandem"]["prefill_worker"] == "p1"
    assert holder.requests[0].remote_prefill is True
    for body in (first, second):
        assert body["tandem"]["kv_bytes"] == 4096 and body["tandem"]["migrations"] == 0
    rows = {w["worker_id"]: w for w in described["workers"]}
    assert rows[holder.worker_id]["cached_blocks"] == len(hashes)


def test_metrics_show_kv_bytes_per_request_and_the_workers_counters(model, tokens):
    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode",
                                        Script(tokens=tokens, kv_bytes_received=12288))
            prefill.status.kv.CopyFrom(pb.KVTransferCounters(
                backend="zmq", bytes_sent=12288, transfers_done=1, transfers_failed=2,
                transfer_seconds=0.25, skipped_blocks=5))
            decode.status.kv.CopyFrom(pb.KVTransferCounters(
                backend="zmq", bytes_received=12288, transfers_done=1))
            records = [h.coordinator.registry.get(w) for w in ("p1", "d1")]
            await wait_until(lambda: all(r.kv is not None for r in records),
                             "the counters to arrive in a heartbeat")
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                body = await chat(client, h.url)
                return body, (await client.get(f"{h.url}/metrics")).text

    body, metrics = run(scenario())
    assert body["tandem"]["kv_bytes"] == 12288
    got = samples(metrics)
    hist = "tandem_kv_transfer_bytes_per_request"
    assert got[f"{hist}_count", (("worker", "d1"),)] == 1
    assert got[f"{hist}_sum", (("worker", "d1"),)] == 12288
    assert got[f"{hist}_bucket", (("le", "16384.0"), ("worker", "d1"))] == 1
    assert got[f"{hist}_bucket", (("le", "4096.0"), ("worker", "d1"))] == 0
    assert got["tandem_request_migrations_total", ()] == 0
    p1 = (("backend", "zmq"), ("role", "prefill"), ("worker", "p1"))
    d1 = (("backend", "zmq"), ("role", "decode"), ("worker", "d1"))
    assert got["tandem_worker_kv_sent_bytes_total", p1] == 12288
    assert got["tandem_worker_kv_transfers_total", (p1[0], ("outcome", "done"), *p1[1:])] == 1
    assert got["tandem_worker_kv_transfers_total", (p1[0], ("outcome", "failed"), *p1[1:])] == 2
    assert got["tandem_worker_kv_transfer_seconds_total", p1] == 0.25
    assert got["tandem_worker_kv_skipped_blocks_total", p1] == 5
    assert got["tandem_worker_kv_received_bytes_total", d1] == 12288
    assert got["tandem_worker_kv_sent_bytes_total", d1] == 0


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, its labels sorted by name) -> value, from the exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
