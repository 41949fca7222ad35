"""A worker with several coordinators (`--coordinator A,B`): one registration and heartbeat
loop per coordinator, each with its own proofs, none waiting on another; an unreachable one
is given up alone, the worker exiting only once every one is. In-process registries, no
model."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from common.cluster_auth import ClusterAuth
from common.rpc import worker_pb2 as pb
from coordinator.config import CoordinatorConfig
from coordinator.registry import WorkerRegistry, start_registry_server
from deploy.process_plan import free_port
from worker.config import coordinator_list
from worker.node_server import CoordinatorLost, NodeFailure, NodeIdentity, register_everywhere

SECRET = b"s" * 32
IDENTITY = NodeIdentity("decode-0", "decode", "127.0.0.1:1", "", "zmq", "fp", "layout")


async def _registries(n: int, auth: ClusterAuth):
    """n registries on free ports, heartbeats every 50 ms; (registry, address, server, beats)
    each, `beats` counting the Heartbeat calls it answered."""
    out = []
    for _ in range(n):
        registry = WorkerRegistry(CoordinatorConfig(cluster_auth=auth, heartbeat_interval_s=0.05), "fp")
        server, port = await start_registry_server(registry, "127.0.0.1", 0)
        beats: list[int] = []
        answer = registry.heartbeat
        registry.heartbeat = lambda request, a=answer, b=beats: (b.append(1), a(request))[1]
        out.append((registry, f"127.0.0.1:{port}", server, beats))
    return out


async def _until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.01)


def test_the_worker_registers_and_heartbeats_with_every_coordinator_and_outlives_one(caplog):
    caplog.set_level(logging.WARNING, logger="tandem.node")
    auth = ClusterAuth(SECRET)

    async def run():
        (ra, a, server_a, beats_a), (rb, b, server_b, beats_b) = await _registries(2, auth)
        stop = asyncio.Event()
        task = asyncio.create_task(register_everywhere((a, b), IDENTITY, pb.WorkerStatus, stop,
                                                       auth, retry_s=0.5))
        try:
            # Each registry checked its own proof of the secret (a wrong one is refused).
            await _until(lambda: ra.get("decode-0") and rb.get("decode-0"), "registered twice")
            await _until(lambda: len(beats_a) >= 2 and len(beats_b) >= 2, "heartbeats to both")
            await server_a.stop(0)  # coordinator A dies: B keeps hearing from us
            seen = len(beats_b)
            await _until(lambda: len(beats_b) >= seen + 5, "heartbeats to B after A died")
            # A given up after retry_s, the loop for B goes on.
            await _until(lambda: any(f"coordinator {a} unreachable for" in r.message
                                     and f"serving on for {b}" in r.message
                                     for r in caplog.records), "A given up")
            assert not task.done()
            seen = len(beats_b)
            await _until(lambda: len(beats_b) >= seen + 3, "heartbeats to B after A was given up")
            assert rb.get("decode-0").alive
            stop.set()
            await asyncio.wait_for(task, 10)  # a requested stop ends it without an error
        finally:
            stop.set()
            task.cancel()
            await server_b.stop(0)
            for r in (ra, rb):
                await r.close()

    asyncio.run(run())


def test_a_silent_coordinator_never_delays_the_others_heartbeats(caplog):
    """A listener that never speaks (a host that stopped answering): each Register call to it
    waits its whole 5 s timeout; the other coordinator must be registered and heartbeated
    before the first such call ends (logged as unreachable)."""
    auth = ClusterAuth()

    async def run():
        [(rb, b, server_b, beats_b)] = await _registries(1, auth)
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts connections; nobody ever reads them
        s = f"127.0.0.1:{silent.getsockname()[1]}"
        stop = asyncio.Event()
        task = asyncio.create_task(register_everywhere((s, b), IDENTITY, pb.WorkerStatus, stop,
                                                       auth))
        try:
            with caplog.at_level(logging.WARNING, logger="tandem.node"):
                await _until(lambda: len(beats_b) >= 5, "heartbeats to the live coordinator")
                waited_out = [r for r in caplog.records if f"coordinator {s} unreachable" in r.message]
            assert waited_out == []  # the silent one's first call is still waiting
            assert rb.get("decode-0").alive
        finally:
            stop.set()
            task.cancel()
            await server_b.stop(0)
            await rb.close()
            silent.close()

    asyncio.run(run())


def test_the_worker_gives_up_only_when_every_coordinator_is_lost():
    nobody = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")

    async def run():
        await asyncio.wait_for(register_everywhere(nobody, IDENTITY, pb.WorkerStatus,
                                                   asyncio.Event(), retry_s=0.3), 30)

    with pytest.raises(CoordinatorLost, match="unreachable for"):
        asyncio.run(run())


def test_a_refusal_by_any_coordinator_is_fatal():
    async def run():
        [(ra, a, server_a, _)] = await _registries(1, ClusterAuth(SECRET))
        nobody = f"127.0.0.1:{free_port()}"
        try:
            # No secret on our side: the registry refuses us, whatever the other one does.
            await asyncio.wait_for(register_everywhere((nobody, a), IDENTITY, pb.WorkerStatus,
                                                       asyncio.Event()), 30)
        finally:
            await server_a.stop(0)
            await ra.close()

    with pytest.raises(NodeFailure, match="registration refused"):
        asyncio.run(run())


def test_coordinator_list_parses_and_names_bad_entries():
    assert coordinator_list(None) == ()
    assert coordinator_list("10.0.0.1:50050") == ("10.0.0.1:50050",)
    assert coordinator_list("a:1, b:2") == ("a:1", "b:2")
    assert coordinator_list("[::1]:50050,127.0.0.1:50051") == ("[::1]:50050", "127.0.0.1:50051")
    for bad, message in (("a:1,", "got ''"), ("a", "got 'a'"), ("a:0", "got 'a:0'"),
                         ("a:x", "got 'a:x'"), ("a:1,a:1", "twice")):
        with pytest.raises(ValueError, match=message):
            coordinator_list(bad)
