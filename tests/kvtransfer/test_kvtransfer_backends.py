"""Every backend (fake, zmq, shm, grpc, dist) through one parametrized suite of the contract in
kvtransfer/base.py (hosts and raw clients: tests/helpers/kvtransfer_hosts.py)."""

from __future__ import annotations

import os
import time

import pytest

import kvtransfer as kt
from kvtransfer.message import KVHeader, tensor_bytes
from tests.helpers.kvtransfer_hosts import (  # noqa: F401 (pytest fixtures, used by name)
    BACKENDS, by_transfer, COMPLETE, connected_sender, expect, FAILED, hosts, make_host,
    make_layout, no_leaks, open_receiver, RawClient, RELEASED, same_bytes, send_all,
    SHM_PREFIX, source_cache, wait_all,
)


# Backends whose receivers take units of several layers (HandshakeReply.max_unit_layers).
MULTI_LAYER_BACKENDS = ("zmq", "shm")


# -- the contract, every backend -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_transfers_bit_exact_with_first_token(hosts, backend, dtype):
    host = hosts(backend)
    layout = make_layout(dtype)
    key, endpoint = open_receiver(host, dtype, ipc=(backend == "zmq" and dtype == "bfloat16"))
    # destination blocks, and the source blocks that hold the same request blocks
    plan = {"a": ([3, 4, 5], [0, 1, 2]), "b": ([10, 0], [7, 3]), "c": ([31, 20, 21, 22], [4, 5, 6, 8])}
    expect(host, key, "a", plan["a"][0])  # granted before the sender asks
    source = source_cache(layout, 9, seed=1)
    sender = connected_sender(backend, endpoint, layout)
    for layer in range(layout.num_layers):  # interleaved, as a batched prefill would send
        for rid, (_, src) in plan.items():
            if rid == "c":  # chunked prefill: c arrives in two pieces per layer
                sender.send(rid, layer, 0, source[layer], src[:1])
                sender.send(rid, layer, 1, source[layer], src[1:])
            else:
                sender.send(rid, layer, 0, source[layer], src)
    for i, rid in enumerate(plan):
        sender.finish(rid, 100 + i)
    time.sleep(0.05)
    expect(host, key, "b", plan["b"][0])  # granted after the sender asked
    expect(host, key, "c", plan["c"][0])
    statuses = wait_all(sender, list(plan))
    assert all(s.done for s in statuses.values()), statuses
    events = host.call("wait", key, 3, 10.0)
    assert sorted(events) == [(rid, COMPLETE, "", 100 + i) for i, rid in enumerate(plan)]
    cache = host.call("cache", key)
    for rid, (dst, src) in plan.items():
        assert same_bytes(cache[:, :, dst], source[:, :, src]), rid
    used = {b for dst, _ in plan.values() for b in dst}
    assert not cache[:, :, [b for b in range(32) if b not in used]].any()
    stats = sender.stats()
    # 16 sends (a, b and c's two pieces, each of 4 layers); zmq and shm pack a transfer's queued
    # sends of the next layers' same blocks into one unit (KVHeader.layer_count), so they may
    # need fewer: c's pieces alternate in its queue and never pack, so at least 8 + 1 + 1.
    units = 16 if backend not in MULTI_LAYER_BACKENDS else stats.units
    assert stats.backend == backend and stats.transfers_done == 3 and 10 <= units <= 16
    assert stats.units == units
    assert stats.bytes == 4 * 9 * layout.bytes_per_block_per_layer() and stats.seconds > 0
    rstats = host.call("stats", key)
    assert (rstats.bytes, rstats.units, rstats.transfers_done) == (stats.bytes, units, 3)
    assert sender.failed_peer == ""
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_blocks_and_fully_cached_transfer(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    # "p": the receiver holds blocks 0, 1 from its prefix cache; 2, 3 go to 7, 8.
    expect(host, key, "p", [7, 8], skip=2)
    # "all": every block cached; completes on finish alone, carrying the first token.
    expect(host, key, "all", [], skip=3)
    source = source_cache(layout, 4, seed=2)
    sender = connected_sender(backend, endpoint, layout)
    send_all(sender, "p", source, [0, 1], first_block=0)  # chunk 1: entirely cached
    send_all(sender, "p", source, [2, 3], first_block=2, first_token=5)
    send_all(sender, "all", source, [0, 1, 2], first_token=9)
    statuses = wait_all(sender, ["p", "all"])
    assert all(s.done for s in statuses.values())
    # Stage times for the trace spans (worker/trace_spans.py): each stage after the one before;
    # "all" sent no data unit (every block cached), so only its grant and finish.
    t = statuses["p"].times
    assert 0 < t.asked_ns <= t.granted_ns <= t.first_unit_ns <= t.last_ack_ns <= t.ended_ns
    assert t.granted_ns <= t.finish_ns <= t.ended_ns and t.units == sender.stats().units  # "all" sent none
    t = statuses["all"].times
    assert t.first_unit_ns == t.last_ack_ns == t.units == 0
    assert 0 < t.asked_ns <= t.granted_ns <= t.finish_ns <= t.ended_ns
    events = sorted(host.call("wait", key, 2, 10.0))
    assert events == [("all", COMPLETE, "", 9), ("p", COMPLETE, "", 5)]
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, [7, 8]], source[:, :, [2, 3]])
    assert not cache[:, :, [b for b in range(32) if b not in (7, 8)]].any()
    stats = sender.stats()
    # the second chunk's 4 layers: 4 units, or fewer where queued layers pack (zmq, shm)
    assert stats.skipped_blocks == 5 and (stats.units == 4 or backend in MULTI_LAYER_BACKENDS
                                          and 1 <= stats.units <= 4)
    assert stats.bytes == 4 * 2 * layout.bytes_per_block_per_layer()
    assert host.call("stats", key).skipped_blocks == 5
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("theirs, ours, message", [
    ("float32", make_layout(model_id="other"), "model_id: 'other' != 'tiny'"),
    # A bf16 prefill worker and an fp32 decode worker, and the other way round.
    ("float32", make_layout("bfloat16"), "dtype: 'bfloat16' != 'float32'"),
    ("bfloat16", make_layout("float32"), "dtype: 'float32' != 'bfloat16'"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_refused_at_connect(hosts, backend, theirs, ours, message):
    host = hosts(backend)
    key, endpoint = open_receiver(host, theirs)
    sender = kt.create_sender(backend, connect_timeout_s=10.0)
    with pytest.raises(kt.KVLayoutMismatch, match=message):
        sender.connect(endpoint, ours)
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unexpected_transfer_second_sender_and_grant_bounds(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "r", [0, 1])
    expect(host, key, "short", [2])
    source = source_cache(layout, 4, seed=3)
    first = connected_sender(backend, endpoint, layout, ack_timeout_s=1.0)
    second = connected_sender(backend, endpoint, layout, ack_timeout_s=1.0)
    send_all(first, "ghost", source, [0])  # never expected: no grant ever comes
    send_all(first, "r", source, [0, 1])
    time.sleep(0.2)
    send_all(second, "r", source, [2, 3], first_token=1)  # r is granted to `first`
    refused = wait_all(second, ["r"])["r"]
    assert refused.failed and "refused the grant" in refused.reason and "another sender" in refused.reason
    first.finish("r", 1)
    send_all(first, "short", source, [0, 1])  # the grant holds one block
    statuses = wait_all(first, ["ghost", "r", "short"], timeout=5.0)
    assert statuses["r"].done
    assert statuses["ghost"].failed and "no grant for ghost within 1.0s" in statuses["ghost"].reason
    assert statuses["short"].failed and "block 1 beyond the 1 blocks granted" in statuses["short"].reason
    events = by_transfer(host.call("wait", key, 3, 10.0))
    assert events["r"] == [(COMPLETE, "", 1)]
    assert events["short"][0][0] == FAILED and "sender aborted" in events["short"][0][1]
    assert events["short"][1][0] == RELEASED
    assert "ghost" not in events
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, [0, 1]], source[:, :, [0, 1]])  # the refused sender wrote nothing
    assert not cache[:, :, 2:].any()
    first.close()
    second.close()
    host.call("close", key)


@pytest.mark.parametrize("fault", ["checksum", "fingerprint", "foreign", "duplicate", "unexpected"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_unit_fails_only_its_transfer(hosts, backend, fault):
    """Units no honest sender sends, crafted by hand: refused before a byte reaches the cache
    (shm: before it is accepted, since the writes are one-sided), failing only their transfer."""
    from dataclasses import replace

    host = hosts(backend)
    layout = make_layout()
    # shm's receiver checksums the written blocks itself only with verify="receiver" (by
    # default nobody reads them again: test_kvtransfer_shm.py).
    options = {"verify": "receiver"} if backend == "shm" else {}
    key, endpoint = open_receiver(host, **options)
    expect(host, key, "good", [0])
    expect(host, key, "bad", [1, 2])
    expect(host, key, "victim", [9])
    raw = RawClient(backend, host, key, endpoint, layout)
    grant = raw.ask("bad")
    assert grant.ok
    blocks = {"foreign": (1, 9), "duplicate": (1, 1)}.get(fault, (1, 2))
    p = source_cache(layout, 2, seed=4)[0]
    header = KVHeader.for_payload("bad", 0, blocks, p, layout, seq=1)
    if fault == "checksum":
        header = replace(header, checksum=header.checksum ^ 1)
    elif fault == "fingerprint":
        header = replace(header, fingerprint="0" * len(header.fingerprint))
    elif fault == "unexpected":
        header = replace(header, transfer_id="ghost")
    ack = raw.unit(header, None if backend == "shm" else bytes(tensor_bytes(p)))
    reason = {"checksum": "checksum mismatch", "fingerprint": "fingerprint mismatch",
              "foreign": "blocks [9] are not granted to transfer bad", "duplicate": "duplicate block ids",
              "unexpected": "unexpected transfer ghost"}[fault]
    assert not ack.ok and reason in ack.reason
    raw.abort("bad")  # a failed transfer's sender stops: lets shm release at once
    sender = connected_sender(backend, endpoint, layout)
    send_all(sender, "good", source_cache(layout, 1, seed=5), [0], first_token=3)
    assert wait_all(sender, ["good"])["good"].done
    events = by_transfer(host.call("wait", key, 3, 10.0))
    assert events["good"] == [(COMPLETE, "", 3)]
    if fault == "unexpected":  # nobody to blame but the ghost: "bad" failed only by its abort
        assert "ghost" not in events and events["bad"][0][0] == FAILED
    else:
        assert events["bad"][0][0] == FAILED and reason in events["bad"][0][1]
    assert [e[0] for e in events["bad"]] == [FAILED, RELEASED]
    assert "victim" not in events
    cache = host.call("cache", key)
    assert not cache[:, :, 9].any()
    if backend != "shm" and fault != "checksum":  # refused before any byte was written
        assert not cache[:, :, [1, 2]].any()
    # A checksum mismatch is found during the write into a host cache (one pass), so the bad
    # unit may sit in blocks 1-2: only ever the failed transfer's own, released above.
    raw.close()
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend, options", [("zmq", {}), ("shm", {}), ("shm", {"verify": "receiver"})])
def test_queued_layers_travel_as_one_unit(hosts, backend, options):
    """Every layer and the finish are queued before the grant (the receiver expects the
    transfer only afterwards): they go as one data unit of 4 layers, and land in the right
    layers and blocks."""
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host, **options)
    source = source_cache(layout, 3, seed=7)
    sender = connected_sender(backend, endpoint, layout)
    send_all(sender, "r", source, [2, 0, 1], first_token=5)
    time.sleep(0.2)  # the sender has asked; no grant before expect()
    expect(host, key, "r", [5, 6, 9])
    assert wait_all(sender, ["r"])["r"].done
    assert by_transfer(host.call("wait", key, 1, 10.0))["r"] == [(COMPLETE, "", 5)]
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, [5, 6, 9]], source[:, :, [2, 0, 1]])
    assert not cache[:, :, [b for b in range(32) if b not in (5, 6, 9)]].any()
    assert sender.stats().units == host.call("stats", key).units == 1
    assert sender.stats().bytes == 4 * 3 * layout.bytes_per_block_per_layer()
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("fault", [None, "beyond", "short", "checksum"])
@pytest.mark.parametrize("backend", ["fake", "zmq", "shm"])
def test_hand_made_multi_layer_units(hosts, backend, fault):
    """A unit of layers 1-2 crafted by hand: written into exactly those layers when it is
    right; refused before a byte reaches the cache when it names layers beyond the layout or
    carries fewer bytes than its layers need; when it does not match its checksum, refused
    with its transfer failed and no byte outside that transfer's blocks."""
    from dataclasses import replace

    from kvtransfer.message import checksum

    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host, **({"verify": "receiver"} if backend == "shm" else {}))
    expect(host, key, "m", [3, 4])
    raw = RawClient(backend, host, key, endpoint, layout)
    assert raw.ask("m").ok
    source = source_cache(layout, 2, seed=8)
    payload = source[1:3].contiguous()  # layers 1 and 2, blocks 0 and 1: [2, 2, n=2, ...]
    header = KVHeader.for_payload("m", 1, (3, 4), None, layout, seq=1,
                                  crc=checksum(payload), layer_count=2)
    data = bytes(tensor_bytes(payload))
    if fault == "beyond":
        header = replace(header, layer=3)
    elif fault == "short":
        data = data[:len(data) // 2]
        header = replace(header, payload_nbytes=len(data)) if backend == "shm" else header
    elif fault == "checksum":
        header = replace(header, checksum=header.checksum ^ 1)
    if backend == "shm":  # one-sided: the blocks are written in place, then the header says so
        written = host.call("cache", key)
        assert not written.any()
        host.call("write", key, [1, 2], [3, 4], payload)
    ack = raw.unit(header, None if backend == "shm" else data)
    cache = host.call("cache", key)
    if fault is None:
        assert ack.ok, ack.reason
        assert same_bytes(cache[1:3, :, [3, 4]], payload)
        assert not cache[[0, 3]].any()
    else:
        reason = {"beyond": "layers [3, 5) out of range [0, 4)",
                  "short": "payload_nbytes" if backend == "shm" else "payload has",
                  "checksum": "checksum mismatch on layers 1-2"}[fault]
        assert not ack.ok and reason in ack.reason, ack.reason
        if backend != "shm":
            # A checksum is checked during the write into a host cache: the refused unit may
            # sit in its own transfer's blocks (3, 4 of layers 1-2), never anywhere else.
            landed = cache.clone()
            if fault == "checksum":
                landed[1:3, :, [3, 4]] = 0
            assert not landed.any()
    raw.close()
    host.call("close", key)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_frames", [None, 0])
def test_zmq_sends_block_runs_as_frames_or_stages_scattered_blocks(hosts, monkeypatch, max_frames, dtype):
    """zmq sends a unit straight from the source blocks, one frame per run of consecutive
    blocks (no staging buffer), unless that takes more than MAX_DIRECT_FRAMES frames: then it
    gathers the blocks into one staged frame. Either way each block lands where it belongs."""
    import kvtransfer.zmq_backend as zb

    monkeypatch.setattr(zb, "MIN_DIRECT_FRAME_BYTES", 1)  # the tiny layout's blocks are small
    if max_frames is not None:
        monkeypatch.setattr(zb, "MAX_DIRECT_FRAMES", max_frames)
    host = hosts("zmq")
    layout = make_layout(dtype)
    key, endpoint = open_receiver(host, dtype)
    src, dst = [6, 7, 0, 2, 3], [20, 21, 22, 5, 9]  # runs 6-7, 0, 2-3 at the source
    expect(host, key, "r", dst)
    source = source_cache(layout, 8, seed=12)
    sender = connected_sender("zmq", endpoint, layout)
    send_all(sender, "r", source, src, first_token=4)
    assert wait_all(sender, ["r"])["r"].done
    assert by_transfer(host.call("wait", key, 2, 10.0))["r"] == [(COMPLETE, "", 4)]
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, dst], source[:, :, src])
    assert not cache[:, :, [b for b in range(32) if b not in dst]].any()
    staged = bool(sender._pool._entries)  # the staging buffers a unit took, if any
    assert staged == (max_frames == 0)
    sender.close()
    host.call("close", key)


def test_zmq_direct_segments(monkeypatch):
    """The views a zmq unit is sent as: each layer's K runs then its V runs, the payload's order;
    None for more frames than allowed, frames under the floor, or a source that is not a
    contiguous host tensor."""
    import torch

    import kvtransfer.zmq_backend as zb
    from kvtransfer.zmq_backend import MAX_DIRECT_FRAMES, direct_segments

    layout = make_layout()
    block_bytes = layout.bytes_per_block_per_layer() // 2
    monkeypatch.setattr(zb, "MIN_DIRECT_FRAME_BYTES", 2 * block_bytes)  # runs of 2 blocks pass
    assert direct_segments((source_cache(layout, 8, seed=3)[0],), (6, 7, 0)) is None  # run "0"
    monkeypatch.setattr(zb, "MIN_DIRECT_FRAME_BYTES", block_bytes)
    source = source_cache(layout, 8, seed=3)
    ids = (6, 7, 0, 2, 3)
    views = direct_segments((source[1], source[2]), ids)
    assert len(views) == 2 * 2 * 3
    joined = b"".join(bytes(v) for v in views)
    want = b"".join(bytes(tensor_bytes(source[layer][:, list(ids)].contiguous())) for layer in (1, 2))
    assert joined == want
    scattered = tuple(range(0, 2 * MAX_DIRECT_FRAMES, 2))  # one run per block
    big = torch.zeros(2, 2 * MAX_DIRECT_FRAMES, *layout.block_shape())
    assert direct_segments((big,), scattered) is None
    assert direct_segments((source[1].transpose(1, 2),), ids) is None


@pytest.mark.parametrize("cut", ["odd", "short", "long"])
@pytest.mark.parametrize("backend", ["zmq", "grpc"])
def test_unit_cut_into_frames_anywhere(hosts, backend, cut):
    """A data unit's payload may come as several frames (zmq) or stream chunks (gRPC) cut
    anywhere, not on block bounds: it is written as one stream; pieces holding fewer or more
    bytes than the header says are refused and fail the transfer, with nothing written."""
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "m", [3, 4, 8])
    raw = RawClient(backend, host, key, endpoint, layout)
    assert raw.ask("m").ok
    payload = source_cache(layout, 3, seed=9)[0].contiguous()  # layer 0, three blocks
    header = KVHeader.for_payload("m", 0, (3, 4, 8), payload, layout, seq=1)
    data = bytes(tensor_bytes(payload))
    frames = [data[:5], data[5:6], data[6:1001], data[1001:]]
    if cut == "short":
        frames[-1] = frames[-1][:-4]
    elif cut == "long":
        frames.append(b"1234")
    ack = raw.unit(header, frames)
    cache = host.call("cache", key)
    if cut == "odd":
        assert ack.ok, ack.reason
        assert same_bytes(cache[0, :, [3, 4, 8]], payload)
    else:
        assert not ack.ok and "payload has" in ack.reason, ack.reason
        assert not cache.any()
    raw.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deadline_cancel_and_released_exactly_once(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "slow", [0], deadline_s=0.4)
    expect(host, key, "gone", [1])
    expect(host, key, "done", [2])
    source = source_cache(layout, 1, seed=6)
    sender = connected_sender(backend, endpoint, layout)
    sender.send("slow", 0, 0, source[0], [0])  # one layer, then nothing
    sender.send("gone", 0, 0, source[0], [0])
    send_all(sender, "done", source, [0], first_token=8)
    assert wait_all(sender, ["done"])["done"].done
    events = by_transfer(host.call("wait", key, 3, 5.0))
    assert events["done"] == [(COMPLETE, "", 8)]
    assert [e[0] for e in events["slow"]] == [FAILED, RELEASED]
    assert "deadline passed with 1/4 layers" in events["slow"][0][1]
    sender.finish("slow", 0)
    assert wait_all(sender, ["slow"])["slow"].failed  # revoked (zmq, shm, fake) or refused (grpc)
    host.call("cancel", key, "gone")
    host.call("cancel", key, "gone")  # idempotent
    host.call("cancel", key, "done")  # after COMPLETE: nothing to release
    host.call("cancel", key, "slow")  # after FAILED: its RELEASED came already
    assert host.call("wait", key, 1, 5.0) == [("gone", RELEASED, "", None)]  # no FAILED for a cancel
    for layer in range(1, layout.num_layers):
        sender.send("gone", layer, 0, source[layer], [0])
    status = wait_all(sender, ["gone"])["gone"]
    assert status.failed and ("cancelled" in status.reason or "revoked" in status.reason), status
    assert host.call("wait", key, 1, 0.3) == []  # exactly once
    cache = host.call("cache", key)
    assert cache[0, :, 1].any() and not cache[1:, :, 1].any()
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_fails_and_releases(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "mid", [4, 5])
    source = source_cache(layout, 2, seed=7)
    sender = connected_sender(backend, endpoint, layout)
    send_all(sender, "mid", source, [0, 1], layers=range(2))
    sender.abort("mid", "prefill cancelled")
    sender.abort("mid", "again")  # idempotent
    sender.abort("early", "prefill failed")  # before the receiver even expects it
    statuses = wait_all(sender, ["mid", "early"])
    assert statuses["mid"].failed and "aborted: prefill cancelled" in statuses["mid"].reason
    assert statuses["early"].failed and "aborted: prefill failed" in statuses["early"].reason
    events = by_transfer(host.call("wait", key, 2, 5.0))
    assert events["mid"][0] == (FAILED, "sender aborted: prefill cancelled", None)
    assert events["mid"][1][0] == RELEASED
    time.sleep(0.2)  # the early abort travels to the receiver
    expect(host, key, "early", [6])
    events = host.call("wait", key, 2, 5.0)
    assert [(e[0], e[1]) for e in events] == [("early", FAILED), ("early", RELEASED)]
    assert "prefill failed" in events[0][2]
    assert host.call("stats", key).transfers_failed == 2
    assert sender.stats().transfers_failed == 2
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_death_fails_sender_and_marks_peer(tmp_path, backend):
    host = make_host(backend, tmp_path)
    layout = make_layout()
    key = endpoint = ""
    try:
        key, endpoint = open_receiver(host)
        expect(host, key, "r", [0])
        sender = connected_sender(backend, endpoint, layout, ack_timeout_s=1.0)
        host.die()
        start = time.monotonic()
        send_all(sender, "r", source_cache(layout, 1, seed=8), [0], first_token=0)
        status = wait_all(sender, ["r"], timeout=10.0)["r"]
        assert status.failed, status
        deadline = time.monotonic() + 10.0
        while not sender.failed_peer and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sender.failed_peer, "a dead receiver must mark the sender's peer as failed"
        # A bound against a hang, not a speed target: ack_timeout_s is 1 s; a loaded 2-core
        # host may take several times that to schedule the I/O thread.
        assert time.monotonic() - start < 12
        sender.send("later", 0, 0, source_cache(layout, 1, seed=8)[0], [0])
        assert wait_all(sender, ["later"], timeout=1.0)["later"].failed  # at once
        sender.close()
    finally:
        host.stop()
        # The dead receiver could not unlink its segments, named by its own process's prefix.
        prefix = f"tkvt{host.proc.pid}" if hasattr(host, "proc") else SHM_PREFIX
        for name in (f"{prefix}-{key}", f"{prefix}-{key}-own"):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            os.unlink(endpoint[6:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_close_fails_open_transfers_and_releases(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "open", [3])
    sender = connected_sender(backend, endpoint, layout)
    sender.send("open", 0, 0, source_cache(layout, 1, seed=9)[0], [0])
    time.sleep(0.2)
    sender.close()
    sender.close()  # idempotent
    assert sender.poll("open").failed
    with pytest.raises(kt.KVTransferError, match="closed"):
        sender.send("open", 1, 0, source_cache(layout, 1, seed=9)[1], [0])
    if backend != "grpc":  # zmq/shm/fake say goodbye; grpc's receiver waits for the deadline
        events = host.call("wait", key, 2, 5.0)
        assert [(e[0], e[1]) for e in events] == [("open", FAILED), ("open", RELEASED)]
    else:
        host.call("cancel", key, "open")
        assert host.call("wait", key, 1, 5.0) == [("open", RELEASED, "", None)]
    host.call("close", key)


@pytest.mark.parametrize("backend", ["zmq", "dist"])
def test_a_silent_granted_sender_fails_its_transfer_and_a_pinging_one_does_not(hosts, backend):
    """A cut link sends no goodbye, and the fence sees only this host's processes: a receiver
    that does every write itself fails the transfers of a granted sender silent for
    sender_silence_s (here 1.5 s: three of the honest sender's pings, one per ack_timeout_s / 4), so they are placed again instead of waiting out their
    deadline; an honest sender between two layers (pinging while its transfer is open) is not
    taken for silent."""
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host, sender_silence_s=1.5)
    expect(host, key, "mute", [0], deadline_s=60.0)
    expect(host, key, "slow", [1], deadline_s=60.0)
    raw = RawClient(backend, host, key, endpoint, layout)
    assert raw.ask("mute").ok  # granted, then nothing: the raw client never pings
    source = source_cache(layout, 1, seed=11)
    sender = connected_sender(backend, endpoint, layout, ack_timeout_s=2.0)
    sender.send("slow", 0, 0, source[0], [0])
    events = host.call("wait", key, 2, 15.0)
    assert [(e[0], e[1]) for e in events] == [("mute", FAILED), ("mute", RELEASED)], events
    assert "sender silent" in events[0][2]
    time.sleep(3.0)  # twice the silence bound, between two layers of "slow"
    send_all(sender, "slow", source, [0], first_token=5, layers=range(1, layout.num_layers))
    assert wait_all(sender, ["slow"])["slow"].done
    assert host.call("wait", key, 1, 5.0) == [("slow", COMPLETE, "", 5)]
    sender.close()
    host.call("close", key)
