"""What the torch.distributed backend adds to the contract (every contract test also runs on it:
tests/kvtransfer/test_kvtransfer_backends.py; greedy output through a real cluster on it:
tests/nodes/test_disaggregation.py): the per-pair process group, the stream that stays aligned
whatever the receiver refuses, and killed senders that release their blocks."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

import kvtransfer as kt
from kvtransfer import dist_group
from kvtransfer.message import Ack, KVHeader, tensor_bytes
from tests.helpers.kvtransfer_hosts import (  # noqa: F401 (pytest fixtures, used by name)
    COMPLETE, FAILED, RELEASED, RawClient, by_transfer, connected_sender, expect, hosts,
    make_host, make_layout, no_leaks, open_receiver, same_bytes, send_all, source_cache, wait_all,
)


def _events(receiver: kt.KVReceiver, n: int, timeout: float = 15.0) -> list[kt.ReceiveEvent]:
    events, deadline = [], time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        events += receiver.poll()
        time.sleep(0.01)
    return events


@pytest.fixture
def receiver():
    layout = make_layout()
    cache = kt.allocate_cache(layout, 16)
    r = kt.create_receiver("dist", cache, layout)
    yield r
    r.close()
    cache.close()


# -- the pair's process group ---------------------------------------------------------------------


def _rank_one(port: int, sender_id: str) -> None:
    torch.set_num_threads(1)
    store = dist_group.join_store("127.0.0.1", port, 20.0)
    group = dist_group.pair_group(store, sender_id, dist_group.SENDER_RANK, "gloo", "127.0.0.1", 20.0)
    first = torch.arange(24, dtype=torch.float32).to(torch.bfloat16)
    second = torch.full((5,), 7, dtype=torch.uint8)
    # Posted back to back, received in this order. A send lives only as long as its Work, and
    # only wait() completes it (DistSender keeps each until its unit's ack, then waits).
    works = [group.send([t], dist_group.RECEIVER_RANK, dist_group.TAG)
             for t in (first.view(torch.uint8), second)]
    group.recv([torch.empty(1, dtype=torch.uint8)], dist_group.RECEIVER_RANK, dist_group.TAG).wait()
    for w in works:
        w.wait()
    assert all(w.is_completed() for w in works)


def test_pair_group_between_processes_keeps_order_and_bytes():
    assert dist_group.group_backend(torch.device("cpu"), sender_gpu="GPU-a") == "gloo"
    assert dist_group.group_backend(torch.device("cuda", 0), sender_gpu="") == "gloo"
    assert dist_group.group_backend(torch.device("cuda", 0), "GPU-a", receiver_gpu="GPU-b") == "nccl"
    # NCCL refuses two ranks on one GPU: roles sharing it pair over gloo, through the host.
    assert dist_group.group_backend(torch.device("cuda", 0), "GPU-a", receiver_gpu="GPU-a") == "gloo"
    assert dist_group.endpoint_host("tcp://10.1.2.3:5555") == "10.1.2.3"
    assert dist_group.endpoint_host("ipc:///tmp/x.sock") == "127.0.0.1"
    store = dist_group.host_store("127.0.0.1", 20.0)
    proc = mp.get_context("spawn").Process(target=_rank_one, args=(store.port, "s-1"), daemon=True)
    proc.start()
    try:
        group = dist_group.pair_group(store, "s-1", dist_group.RECEIVER_RANK, "gloo", "127.0.0.1", 20.0)
        first, second = torch.empty(48, dtype=torch.uint8), torch.empty(5, dtype=torch.uint8)
        group.recv([first], dist_group.SENDER_RANK, dist_group.TAG).wait()
        group.recv([second], dist_group.SENDER_RANK, dist_group.TAG).wait()
        want = torch.arange(24, dtype=torch.float32).to(torch.bfloat16)
        assert torch.equal(first.view(torch.bfloat16), want)
        assert second.tolist() == [7] * 5
        group.send([torch.ones(1, dtype=torch.uint8)], dist_group.SENDER_RANK, dist_group.TAG).wait()
    finally:
        proc.join(20)
    assert proc.exitcode == 0


def test_each_sender_gets_its_own_pair_and_it_goes_with_the_sender(receiver):
    layout = make_layout()
    source = source_cache(layout, 4, seed=21)
    receiver.expect("a", [0, 1], 4, 20.0)
    receiver.expect("b", [8, 9], 4, 20.0)
    one = connected_sender("dist", receiver.endpoint, layout)
    two = connected_sender("dist", receiver.endpoint, layout)
    assert set(receiver._pairs) == {one.sender_id, two.sender_id}
    for layer in range(layout.num_layers):  # the two pairs' streams interleave
        one.send("a", layer, 0, source[layer], [0, 1])
        two.send("b", layer, 0, source[layer], [2, 3])
    one.finish("a", 1)
    two.finish("b", 2)
    assert wait_all(one, ["a"])["a"].done and wait_all(two, ["b"])["b"].done
    assert sorted((e.request_id, e.kind.value, e.first_token) for e in _events(receiver, 2)) == [
        ("a", COMPLETE, 1), ("b", COMPLETE, 2)]
    assert same_bytes(receiver.cache.tensor[:, :, [0, 1]], source[:, :, [0, 1]])
    assert same_bytes(receiver.cache.tensor[:, :, [8, 9]], source[:, :, [2, 3]])
    assert receiver.stats().backend == "dist" and receiver.stats().units == 8
    one.close()
    deadline = time.monotonic() + 10
    while one.sender_id in receiver._pairs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(receiver._pairs) == {two.sender_id}
    two.close()


def test_layout_mismatch_and_non_dist_receiver_make_no_pair(receiver):
    sender = kt.create_sender("dist", connect_timeout_s=10.0)
    with pytest.raises(kt.KVLayoutMismatch, match="model_id: 'other' != 'tiny'"):
        sender.connect(receiver.endpoint, make_layout(model_id="other"))
    sender.close()
    time.sleep(0.2)
    assert receiver._pairs == {}
    layout = make_layout()
    cache = kt.allocate_cache(layout, 4)
    plain = kt.create_receiver("zmq", cache, layout)
    try:
        sender = kt.create_sender("dist", connect_timeout_s=1.0)
        with pytest.raises(kt.KVTransferError, match="not a dist receiver"):
            sender.connect(plain.endpoint, layout)
        sender.close()
    finally:
        plain.close()
        cache.close()


def test_deploy_lists_every_real_backend():
    from worker.config import KV_BACKENDS

    assert sorted(KV_BACKENDS) == sorted(b for b in kt.backends() if b != "fake")


# -- the stream stays aligned ----------------------------------------------------------------------


def _finish(raw: RawClient, rid: str, first_token: int, num_units: int) -> None:
    raw.sock.send_multipart([b"C", KVHeader(rid, seq=999, sender_id=raw.sender_id, finish=True,
                                            first_token=first_token, num_units=num_units).encode()])


def test_refused_units_are_received_all_the_same_so_the_next_lands(hosts):
    """Units the table refuses (an unknown transfer, a bad checksum), of other sizes than the
    ones around them, then good units on the same pair: each lands where its header says."""
    host = hosts("dist")
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "bad", [1, 2])
    expect(host, key, "good", [5, 6, 7])
    raw = RawClient("dist", host, key, endpoint, layout)
    assert raw.ask("bad").ok and raw.ask("good").ok
    source = source_cache(layout, 3, seed=22)
    junk = torch.full_like(source, 3.0)
    ghost = KVHeader.for_payload("ghost", 0, (1,), junk[0][:, :1].contiguous(), layout, seq=1)
    ack = raw.unit(ghost, bytes(tensor_bytes(junk[0][:, :1].contiguous())))
    assert not ack.ok and "unexpected transfer ghost" in ack.reason
    bad_payload = junk[0][:, :2].contiguous()
    bad = KVHeader.for_payload("bad", 0, (1, 2), bad_payload, layout, seq=2)
    ack = raw.unit(replace(bad, checksum=bad.checksum ^ 1), bytes(tensor_bytes(bad_payload)))
    assert not ack.ok and "checksum mismatch" in ack.reason
    for layer in range(layout.num_layers):
        payload = source[layer].contiguous()
        header = KVHeader.for_payload("good", layer, (5, 6, 7), payload, layout, seq=10 + layer)
        ack = raw.unit(header, bytes(tensor_bytes(payload)))
        assert ack.ok, ack
    _finish(raw, "good", 6, layout.num_layers)
    events = by_transfer(host.call("wait", key, 3, 10.0))
    assert events["good"] == [(COMPLETE, "", 6)]
    assert [e[0] for e in events["bad"]] == [FAILED, RELEASED] and "checksum" in events["bad"][0][1]
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, [5, 6, 7]], source)
    # The refused unit (layer 0 of "bad") may sit in bad's own blocks, checked during that
    # write; nothing else of bad's reached the cache.
    assert not cache[1:, :, [1, 2]].any()
    raw.close()
    host.call("close", key)


def test_oversized_declaration_kills_only_its_pair(hosts):
    host = hosts("dist")
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "liar", [0])
    expect(host, key, "honest", [3])
    raw = RawClient("dist", host, key, endpoint, layout)
    assert raw.ask("liar").ok
    header = KVHeader.for_payload("liar", 0, (0,), source_cache(layout, 1, seed=23)[0], layout, seq=1)
    too_big = layout.payload_nbytes(32) + 1  # more than one layer of the whole cache
    header = replace(header, payload_nbytes=too_big, sender_id=raw.sender_id)
    raw.sock.send_multipart([b"T", header.encode()])  # and no tensor: none may be waited for
    ack = Ack.decode(raw.recv(b"A"))
    assert not ack.ok and "outside" in ack.reason
    events = by_transfer(host.call("wait", key, 2, 10.0))
    assert [e[0] for e in events["liar"]] == [FAILED, RELEASED] and "declares" in events["liar"][0][1]
    sender = connected_sender("dist", endpoint, layout)  # another pair is untouched
    send_all(sender, "honest", source_cache(layout, 1, seed=24), [0], first_token=2)
    assert wait_all(sender, ["honest"])["honest"].done
    assert host.call("wait", key, 1, 10.0) == [("honest", COMPLETE, "", 2)]
    sender.close()
    raw.close()
    host.call("close", key)


# -- killed senders --------------------------------------------------------------------------------


def _doomed_sender(conn, endpoint: str, mode: str) -> None:
    """Sends part of transfer "r", says so, then waits to be killed."""
    torch.set_num_threads(1)
    layout = make_layout()
    source = source_cache(layout, 2, seed=25)
    if mode == "between-units":  # an honest sender; the receiver's fence sees its death
        sender = connected_sender("dist", endpoint, layout)
        for layer in range(2):
            sender.send("r", layer, 0, source[layer], [0, 1])
    else:  # "mid-unit": unfenceable, a header whose tensor never comes: the recv is pending
        from kvtransfer import fence

        fence.own_identity = lambda: (0, 0)
        raw = RawClient("dist", None, "", endpoint, layout)
        assert raw.ask("r").ok
        header = KVHeader.for_payload("r", 0, (4, 5), source[0], layout, seq=1, sender_id=raw.sender_id)
        raw.sock.send_multipart([b"T", header.encode()])
    conn.send("sent")
    time.sleep(120)


@pytest.mark.parametrize("mode, reason", [("between-units", "is gone"),
                                          ("mid-unit", "Connection closed by peer")])
def test_killed_sender_process_fails_and_releases_without_a_hang(receiver, mode, reason):
    layout = make_layout()
    receiver.expect("r", [4, 5], 4, 60.0)  # a deadline far beyond the bound below
    conn, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_doomed_sender, args=(child, receiver.endpoint, mode),
                                           daemon=True)
    proc.start()
    try:
        assert conn.poll(30) and conn.recv() == "sent"
        deadline = time.monotonic() + 10
        want_units = 2 if mode == "between-units" else 0
        while receiver.stats().units < want_units and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.stats().units == want_units
        time.sleep(0.2)  # mid-unit: the pair's thread is now waiting in its recv
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        events = _events(receiver, 2)
        assert [e.kind for e in events] == [kt.ReceiveKind.FAILED, kt.ReceiveKind.RELEASED], events
        assert reason in events[0].reason, events[0].reason
        assert time.monotonic() - start < 15  # against a hang, not a speed target
    finally:
        proc.kill()
        proc.join(10)
    # The receiver's loop is not stuck: the released blocks serve the next sender at once.
    source = source_cache(layout, 2, seed=26)
    receiver.expect("next", [4, 5], 4, 20.0)
    sender = connected_sender("dist", receiver.endpoint, layout)
    send_all(sender, "next", source, [0, 1], first_token=9)
    assert wait_all(sender, ["next"])["next"].done
    assert [(e.request_id, e.kind) for e in _events(receiver, 1)] == [("next", kt.ReceiveKind.COMPLETE)]
    assert same_bytes(receiver.cache.tensor[:, :, [4, 5]], source)
    sender.close()


def test_cluster_credentials_cover_the_control_channel_and_every_unit():
    """With a KVAuth the pairing happens over zmq's CURVE channel, and each unit's token is
    checked after its tensor was received (so a refused unit keeps the stream aligned too)."""
    from kvtransfer.auth import KVAuth

    layout = make_layout()
    cache = kt.allocate_cache(layout, 8)
    receiver = kt.create_receiver("dist", cache, layout, auth=KVAuth(b"k" * 32))
    try:
        stranger = kt.create_sender("dist", connect_timeout_s=1.0)  # no credentials: no pair
        with pytest.raises(kt.KVTransferError):
            stranger.connect(receiver.endpoint, layout)
        stranger.close()
        source = source_cache(layout, 1, seed=27)
        receiver.expect("t", [2], 4, 20.0)
        sender = connected_sender("dist", receiver.endpoint, layout, auth=KVAuth(b"k" * 32))
        send_all(sender, "t", source, [0], first_token=5)
        assert wait_all(sender, ["t"])["t"].done
        assert [(e.request_id, e.kind) for e in _events(receiver, 1)] == [("t", kt.ReceiveKind.COMPLETE)]
        assert same_bytes(cache.tensor[:, :, [2]], source)
        sender.close()
    finally:
        receiver.close()
        cache.close()


def test_a_pair_killed_by_the_receiver_marks_the_sender_peer_failed(receiver):
    """The zmq channel still answers pings, but the pair is gone: the sender must learn that
    its connection is done for (failed_peer), not fail every later transfer on a timeout."""
    layout = make_layout()
    sender = connected_sender("dist", receiver.endpoint, layout, ack_timeout_s=20.0)
    receiver._pairs[sender.sender_id].kill("killed by the test")
    deadline = time.monotonic() + 10
    while sender.sender_id in receiver._pairs and time.monotonic() < deadline:
        time.sleep(0.02)
    receiver.expect("after", [1], 4, 20.0)
    send_all(sender, "after", source_cache(layout, 1, seed=28), [0], first_token=1)
    status = wait_all(sender, ["after"], timeout=15.0)["after"]
    assert status.failed and "process group" in status.reason, status
    assert "process group" in sender.failed_peer
    sender.close()
    events = _events(receiver, 2)
    assert [(e.request_id, e.kind) for e in events] == [("after", kt.ReceiveKind.FAILED),
                                                       ("after", kt.ReceiveKind.RELEASED)], events


def test_receiver_killed_with_sends_in_flight_fails_the_sender_without_a_hang(tmp_path):
    host = make_host("dist", tmp_path)
    layout = make_layout()
    source = source_cache(layout, 2, seed=29)
    try:
        key, endpoint = open_receiver(host)
        expect(host, key, "r", [0, 1], deadline_s=60.0)
        sender = connected_sender("dist", endpoint, layout, ack_timeout_s=2.0)
        send_all(sender, "r", source, [0, 1], layers=range(2))
        deadline = time.monotonic() + 10
        while host.call("stats", key).units < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        host.die()
        send_all(sender, "r", source, [0, 1], layers=range(2, 4), first_token=1)  # posted, never received
        # A failed group send (the connection closed) or the heartbeat's silence: either way.
        assert wait_all(sender, ["r"], timeout=15.0)["r"].failed
        deadline = time.monotonic() + 10
        while not sender.failed_peer and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.failed_peer
        start = time.monotonic()
        sender.close()
        assert time.monotonic() - start < 10  # against a hang on the pending sends
    finally:
        host.stop()
