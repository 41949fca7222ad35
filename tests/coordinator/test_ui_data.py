"""/ui/data (coordinator/ui_routes.py) on the real coordinator with fake workers: what each
worker reports reaches the view as reported, a dead worker is shown dead without its reason,
the queue and the latency window are there, and nothing internal is."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_the_view_shows_what_workers_report_and_hides_what_is_internal(model):
    tokens = model.tokenizer.encode("Hi there", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
            decode = await h.add_worker("d1", "decode", Script(tokens=tokens), num_blocks=80)
            spare = await h.add_worker("d2", "decode", Script(tokens=tokens))
            # Reported load and KV counters, as a worker's heartbeat carries them.
            decode.status.num_free_blocks, decode.status.num_running = 60, 2
            decode.status.num_waiting, decode.status.queued_prefill_tokens = 1, 37
            prefill.status.kv.backend, prefill.status.kv.bytes_sent = "zmq", 4096
            prefill.status.kv.transfers_done, prefill.status.kv.transfers_failed = 3, 1
            prefill.status.kv.transfer_seconds = 0.5
            await wait_until(lambda: h.coordinator.registry.get("d1").load.num_running == 2,
                             "the decode worker's heartbeat")
            await wait_until(lambda: h.coordinator.registry.get("p1").kv is not None,
                             "the prefill worker's counters")
            await spare.stop()
            h.coordinator.registry.mark_dead("d2", "did not answer at 127.0.0.1:9 (secret)")
            chat = await client.post(f"{h.url}/api/chat", json={
                "model": "tiny", "messages": [{"role": "user", "content": "a private prompt"}],
                "stream": False})
            data = await client.get(f"{h.url}/ui/data")
        return chat, data

    chat, data = run(scenario())
    assert chat.status_code == 200, chat.text
    assert data.status_code == 200 and data.headers["cache-control"] == "no-store"
    view = data.json()
    workers = {w["id"]: w for w in view["workers"]}
    assert [w["id"] for w in view["workers"]] == ["d1", "p1", "d2"]  # live first, dead last
    d1, p1, d2 = workers["d1"], workers["p1"], workers["d2"]
    assert d1["role"] == "decode" and d1["model"] == "tiny" and d1["alive"]
    assert (d1["kv_blocks"], d1["kv_blocks_used"], d1["kv_usage"]) == (80, 20, 0.25)
    assert (d1["running"], d1["waiting"], d1["queued_prefill_tokens"]) == (2, 1, 37)
    assert p1["kv"] == {"bytes_sent": 4096, "bytes_received": 0, "transfers_done": 3,
                        "transfers_failed": 1, "transfer_seconds": 0.5, "skipped_blocks": 0}
    assert d1["kv"] is None  # a worker that reported no counters has none
    assert d2["alive"] is False
    (tiny,) = view["models"]
    assert tiny["live"] == {"prefill": 1, "decode": 1, "colocated": 0}
    # Live pools only: d1's 20 of 80 and p1's 0 of 100.
    assert tiny["kv_usage"] == pytest.approx(20 / 180)
    assert view["queue"]["waiting"] == 0 and view["default_model"] == "tiny"
    assert view["latency"]["overall"]["requests"] == 1
    assert view["latency"]["overall"]["ttft"] is not None
    text = json.dumps(view)
    for internal in ("127.0.0.1", "secret", "address", "fingerprint", "a private prompt"):
        assert internal not in text
