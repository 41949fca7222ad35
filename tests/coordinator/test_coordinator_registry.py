"""Worker registration, heartbeats and liveness, over the real Registry gRPC service."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.registry import WorkerRegistry
from common.rpc import worker_pb2 as pb
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode("Hello world!", add_special_tokens=False)


def test_registration_accepted_and_refused_on_fingerprint(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            good = await h.add_worker("d1", "decode", Script(tokens=tokens))
            bad = await h.add_worker("d2", "decode", Script(tokens=tokens),
                                     fingerprint="othermodel-0123456789abcdef")
            return good.register_response, bad.register_response, h.coordinator.registry

    good, bad, registry = run(scenario())
    assert good.accepted and good.heartbeat_interval_s == pytest.approx(0.1)
    assert not bad.accepted
    assert "othermodel-0123456789abcdef" in bad.reason and model.fingerprint in bad.reason
    assert registry.get("d2") is None


def test_registration_refuses_bad_role_and_missing_fields():
    registry = WorkerRegistry(CoordinatorConfig(), "fp")
    refused = registry.register(pb.WorkerInfo(worker_id="w", role="boss", address="h:1",
                                              model_fingerprint="fp"))
    assert not refused.accepted and "role 'boss'" in refused.reason
    refused = registry.register(pb.WorkerInfo(worker_id="", role="decode", address="h:1",
                                              model_fingerprint="fp"))
    assert not refused.accepted and "worker_id" in refused.reason


def test_registration_refuses_a_kv_layout_that_cannot_pair():
    async def scenario():  # accepted workers get grpc.aio channels: they need a running loop
        registry = WorkerRegistry(CoordinatorConfig(), "fp")

        def info(worker_id, role, layout):
            return pb.WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{len(worker_id)}",
                                 model_fingerprint="fp", kv_backend="zmq", kv_layout_fingerprint=layout)
        return (registry.register(info("p0", "prefill", "layout-a")),
                registry.register(info("d0", "decode", "layout-b")),
                registry.register(info("d1", "decode", "layout-a")))

    first, other, same = asyncio.run(scenario())
    assert first.accepted and same.accepted
    assert not other.accepted and "layout-b" in other.reason and "layout-a" in other.reason


def test_heartbeat_expiry_marks_dead_and_stops_routing_then_reregistration_revives(
        model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            quiet = await h.add_worker("d1", "decode", Script(tokens=tokens))
            await h.add_worker("d2", "decode", Script(tokens=tokens))
            registry = h.coordinator.registry
            quiet.heartbeating = quiet.status_answers = False  # hung
            await wait_until(lambda: not registry.get("d1").alive, "d1 to be declared dead")
            reason = registry.get("d1").dead_reason
            routed = []
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                for _ in range(3):
                    r = await client.post(f"{h.url}/api/chat", json={
                        "model": "tiny", "messages": MESSAGES, "stream": False})
                    routed.append(r.json()["tandem"]["decode_worker"])
            # The worker speaks again: Heartbeat answers known=false and it registers anew.
            quiet.heartbeating = quiet.status_answers = True
            await wait_until(lambda: registry.get("d1").alive, "d1 to come back")
            return reason, routed, quiet, registry.get("d1").registrations

    reason, routed, quiet, registrations = run(scenario())
    assert "no heartbeat" in reason
    assert routed == ["d2", "d2", "d2"] and quiet.requests == []
    assert registrations == 2


def test_an_embedding_on_a_worker_declared_dead_moves_to_another(model, tokens):
    """A hung worker (no heartbeats, no Status, no answer to Embed) holds an embedding call:
    when the registry declares it dead it ends the worker's calls, and the embedding is
    computed by the worker that joined meanwhile, not failed (nor left to its timeout)."""
    async def scenario():
        async with coordinator_harness(model) as h:
            hung = await h.add_worker("d1", "decode", Script(tokens=tokens))
            hung.heartbeating = hung.status_answers = False
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                call = asyncio.ensure_future(client.post(f"{h.url}/api/embed",
                                                         json={"model": "tiny", "input": "hello"}))
                await wait_until(lambda: hung.requests, "the embedding to reach d1")
                other = await h.add_worker("d2", "decode", Script(tokens=tokens))
                response = await call
            registry = h.coordinator.registry
            return response, registry.get("d1").dead_reason, other.requests

    response, reason, served = run(scenario())
    assert response.status_code == 200, response.text
    assert len(response.json()["embeddings"]) == 1
    assert "no heartbeat" in reason and len(served) == 1


def test_a_worker_whose_heartbeats_stop_but_that_answers_status_stays_routable(model, tokens):
    """Silent for half its deadline, a worker is probed with Status; answering counts as a
    heartbeat (its registration channel broke, not its server)."""
    async def scenario():
        async with coordinator_harness(model, heartbeat_misses=5) as h:
            quiet = await h.add_worker("d1", "decode", Script(tokens=tokens))
            registry = h.coordinator.registry
            quiet.heartbeating = False
            await wait_until(lambda: registry.probes_answered >= 3, "three answered probes")
            alive = registry.get("d1").alive
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                r = await client.post(f"{h.url}/api/chat", json={
                    "model": "tiny", "messages": MESSAGES, "stream": False})
            return alive, r.json()["tandem"]["decode_worker"]

    alive, routed = run(scenario())
    assert alive and routed == "d1"


def test_heartbeat_updates_load_and_unknown_worker_is_told_to_register():
    now = [0.0]
    registry = WorkerRegistry(CoordinatorConfig(heartbeat_interval_s=1.0, heartbeat_misses=3),
                              "fp", clock=lambda: now[0])

    async def scenario():
        assert not registry.heartbeat(pb.HeartbeatRequest(worker_id="w")).known
        assert registry.register(pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                                               model_fingerprint="fp")).accepted
        now[0] = 2.5
        answer = registry.heartbeat(pb.HeartbeatRequest(
            worker_id="w", status=pb.WorkerStatus(num_blocks=10, num_free_blocks=4)))
        assert answer.known and registry.get("w").load.num_free_blocks == 4
        now[0] = 5.4  # 2.9 s of silence: still alive
        assert [r.worker_id for r in registry.live()] == ["w"]
        now[0] = 5.6  # 3.1 s: dead, and its next heartbeat is told to register again
        assert registry.live() == []
        assert not registry.heartbeat(pb.HeartbeatRequest(worker_id="w")).known
        registry.mark_dead("w", "again")  # already dead: the first reason stays
        assert "no heartbeat" in registry.get("w").dead_reason
        await registry.close()

    asyncio.run(scenario())


def test_blocks_released_since_a_status_count_until_the_next_one():
    """What this coordinator's ended requests held there lowers the used blocks placement
    reads, until a status (which counts them freed already) replaces the load."""
    registry = WorkerRegistry(CoordinatorConfig(), "fp")

    async def scenario():
        assert registry.register(pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                                               model_fingerprint="fp")).accepted
        registry.heartbeat(pb.HeartbeatRequest(
            worker_id="w", status=pb.WorkerStatus(num_blocks=100, num_free_blocks=70, block_size=16)))
        record = registry.get("w")
        registry.release(record, 14)
        registry.view("fp").release(record, 6)
        (snap,) = registry.snapshots()
        assert (snap.released_blocks, snap.released_requests) == (20, 2)
        assert record.describe()["released_blocks"] == 20
        registry.heartbeat(pb.HeartbeatRequest(worker_id="w"))  # no status: nothing new counted
        assert registry.snapshots()[0].released_blocks == 20
        registry.heartbeat(pb.HeartbeatRequest(
            worker_id="w", status=pb.WorkerStatus(num_blocks=100, num_free_blocks=90, block_size=16)))
        assert registry.snapshots()[0].released_blocks == 0
        # A record replaced by a re-registration: its status never counted the old one's.
        assert registry.register(pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                                               model_fingerprint="fp")).accepted
        registry.release(record, 9)
        assert registry.snapshots()[0].released_blocks == 0
        await registry.close()

    asyncio.run(scenario())


def test_a_request_sent_before_a_re_registration_never_takes_from_the_new_record():
    """assign() counts against the record a request was placed on: once the worker has
    registered again, the old request's end leaves the new record's counts (what was sent to
    it since) as they are, while the new record's own requests count as before."""
    registry = WorkerRegistry(CoordinatorConfig(), "fp")

    async def scenario():
        info = pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                             model_fingerprint="fp")
        assert registry.register(info).accepted
        old = registry.get("w")
        registry.assign(old, requests=1, prefill_tokens=40)
        assert registry.register(info).accepted
        new = registry.get("w")
        assert new is not old and (new.assigned_requests, new.assigned_prefill_tokens) == (0, 0)
        registry.assign(new, requests=1, prefill_tokens=30)  # sent after the re-registration
        registry.view("fp").assign(new, requests=1)
        registry.assign(old, requests=-1, prefill_tokens=-40)  # the old request ends
        registry.view("fp").assign(old, requests=-1)
        assert (new.assigned_requests, new.assigned_prefill_tokens) == (2, 30)
        registry.assign(new, requests=-1, prefill_tokens=-30)
        assert (registry.snapshots()[0].assigned_requests,
                registry.snapshots()[0].assigned_prefill_tokens) == (1, 0)
        await registry.close()

    asyncio.run(scenario())


def test_a_finished_request_releases_its_blocks_until_the_worker_s_next_status(model, tokens):
    """Through the real coordinator: a chat that a status of d1 counted (one after its first
    token, none after its last) releases its KV blocks there (prompt and the tokens decoded
    by then, in d1's block size) until d1 reports again; one that came and went between two
    statuses releases nothing (no status counted it)."""
    from coordinator.placement import blocks_needed

    async def chat(client, url, stream):
        async with client.stream("POST", f"{url}/api/chat", json={
                "model": "tiny", "messages": MESSAGES, "stream": True}) as r:
            lines = []
            async for line in r.aiter_lines():
                if line.strip():
                    lines.append(json.loads(line))
                    stream(len(lines))
            return lines[-1]

    async def scenario():
        async with coordinator_harness(model, heartbeat_misses=100) as h:  # no probe for 5 s
            d1 = await h.add_worker("d1", "decode", Script(tokens=tokens, token_delay_s=0.3))
            registry = h.coordinator.registry
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                # Statuses come every 0.1 s until the second token; then none.
                def silence(n):
                    if n == 2:
                        d1.heartbeating = False
                counted = await chat(client, h.url, silence)
                released = registry.get("d1").released_blocks
                d1.heartbeating = True
                await wait_until(lambda: registry.get("d1").released_blocks == 0, "d1's next status")
                d1.heartbeating = False  # no status from placement to the end
                while True:  # until any heartbeat already on its way has landed
                    before = registry.get("d1").statuses
                    await asyncio.sleep(0.3)
                    if registry.get("d1").statuses == before:
                        break
                d1.script.token_delay_s = 0.0
                await chat(client, h.url, lambda n: None)
                unseen = registry.get("d1").released_blocks
            return counted, released, unseen

    body, released, unseen = run(scenario())
    assert body["eval_count"] >= 3  # a token after the statuses stopped
    assert released in {blocks_needed(body["prompt_eval_count"] + k, 16)
                        for k in range(1, body["eval_count"])}
    assert released > 0 and unseen == 0


def test_a_live_worker_s_id_from_another_address_is_refused_while_it_answers(model, tokens):
    """A second process started as d1 while d1 lives: refused (logged, counted, on /metrics)
    while d1 answers its Status probe; accepted once d1 stops answering."""
    async def scenario():
        async with coordinator_harness(model) as h:
            first = await h.add_worker("d1", "decode", Script(tokens=tokens))
            second = await h.add_worker("d1", "decode", Script(tokens=tokens))
            registry = h.coordinator.registry
            refused = second.register_response
            held_by = registry.get("d1").address
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                metrics = (await client.get(f"{h.url}/metrics")).text
            first.heartbeating = first.status_answers = False  # gone (hung)
            accepted = await second.register()
            return first, second, refused, held_by, metrics, accepted, registry.get("d1")

    first, second, refused, held_by, metrics, accepted, record = run(scenario())
    assert not refused.accepted and "in use" in refused.reason and first.address in refused.reason
    assert held_by == first.address
    assert ('tandem_grpc_refused_calls_total{method="/tandem.worker.Registry/Register",'
            'process="coordinator",reason="id_in_use"} 1.0') in metrics
    assert accepted.accepted and record.address == second.address and record.alive


def test_a_worker_id_is_bound_to_its_address_and_certificate_identity():
    async def scenario():
        registry = WorkerRegistry(CoordinatorConfig(), "fp")
        info = pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:1",
                             model_fingerprint="fp")
        first = registry.register(info, identity="worker-a")
        again = registry.register(info, identity="worker-a")  # the same worker, again
        other_cert = registry.register(info, identity="worker-b")
        moved = pb.WorkerInfo(worker_id="w", role="decode", address="127.0.0.1:2",
                              model_fingerprint="fp")
        other_address = registry.register(moved, identity="worker-a")
        counts = registry.config.cluster_auth.refused.snapshot()
        await registry.close()
        return first, again, other_cert, other_address, counts

    first, again, other_cert, other_address, counts = asyncio.run(scenario())
    assert first.accepted and again.accepted
    assert not other_cert.accepted and not other_address.accepted
    assert counts == {("/tandem.worker.Registry/Register", "id_in_use"): 2}
