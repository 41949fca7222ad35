"""shm's block reuse only after the writer acknowledged, made deterministic: a writer held
between its owner check and its memcpy; a negative control; the pid fence; the three checks
of a written copy (the writer's read-back, the receiver's crc32c in place, none) (hosts and raw clients: tests/helpers/kvtransfer_hosts.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

import kvtransfer as kt
from kernels.copy_crc32c import copy_crc32c
from kvtransfer.message import KVHeader
from tests.helpers.kvtransfer_hosts import (  # noqa: F401 (pytest fixtures, used by name)
    KEYS, by_transfer, connected_sender, expect, FAILED, hosts, make_layout, no_leaks,
    open_receiver, RELEASED, same_bytes, send_all, SHM_PREFIX, source_cache, wait_all,
)


# -- shm: block reuse only after the writer acknowledged ------------------------------------------


class HeldWriter:
    """A pre_write_hook that holds the writer thread (after its owner check) until released."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()

    def __call__(self, header: KVHeader) -> None:
        self.arrived.set()
        assert self.release.wait(30), "hook never released"


@pytest.fixture
def shm_pair():
    made = []

    def make(num_blocks: int = 8, hook=None):
        layout = make_layout()
        cache = kt.allocate_cache(layout, num_blocks, shared_memory_name=f"{SHM_PREFIX}-race{next(KEYS)}")
        receiver = kt.create_receiver("shm", cache, layout)
        sender = connected_sender("shm", receiver.endpoint, layout, pre_write_hook=hook)
        made.append((sender, receiver, cache))
        return sender, receiver, cache, layout

    yield make
    for sender, receiver, cache in made:
        sender.close()
        receiver.close()
        cache.close()


def poll_events(receiver: kt.KVReceiver, seconds: float, until: int | None = None) -> list:
    events, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and (until is None or len(events) < until):
        events += receiver.poll()
        time.sleep(0.005)
    return events


def _held_cancel(shm_pair):
    """A writer held after its owner check on transfer "t1" (blocks 2, 3), which the receiver
    then cancels: the schedule of the reuse race."""
    hook = HeldWriter()
    sender, receiver, cache, layout = shm_pair(hook=hook)
    old = source_cache(layout, 2, seed=10)
    receiver.expect("t1", [2, 3], layout.num_layers, 20.0)
    sender.send("t1", 0, 0, old[0], [0, 1])
    assert hook.arrived.wait(10), "the writer never reached its write"
    receiver.cancel("t1")
    return hook, sender, receiver, cache, layout, old


def test_shm_blocks_released_only_after_the_writer_acknowledges(shm_pair):
    hook, sender, receiver, cache, layout, old = _held_cancel(shm_pair)
    assert poll_events(receiver, 0.3) == [], "RELEASED while a writer may still write"
    with pytest.raises(ValueError, match="not yet released by t1"):
        receiver.expect("t2", [2, 3], layout.num_layers, 20.0)  # the table refuses early reuse
    hook.release.set()
    events = poll_events(receiver, 5.0, until=1)
    assert events == [kt.ReceiveEvent("t1", kt.ReceiveKind.RELEASED)]
    assert same_bytes(cache.tensor[0][:, [2, 3]], old[0][:, [0, 1]])  # the held write did land...
    assert "revoked" in wait_all(sender, ["t1"])["t1"].reason
    # ... and the blocks now go to t2, whose bytes stay intact: the old writer is gone.
    new = source_cache(layout, 2, seed=11)
    receiver.expect("t2", [2, 3], layout.num_layers, 20.0)
    hook.arrived.clear()
    send_all(sender, "t2", new, [0, 1], first_token=4)
    assert wait_all(sender, ["t2"])["t2"].done
    assert poll_events(receiver, 5.0, until=1) == [kt.ReceiveEvent("t2", kt.ReceiveKind.COMPLETE, first_token=4)]
    time.sleep(0.1)
    assert same_bytes(cache.tensor[:, :, [2, 3]], new[:, :, [0, 1]])


def test_shm_reuse_before_released_is_a_real_hazard(shm_pair):
    """Negative control: the same schedule, but the engine reuses the blocks right after
    cancel() without waiting for RELEASED: the held writer overwrites the new owner's bytes."""
    hook, sender, receiver, cache, layout, old = _held_cancel(shm_pair)
    new = source_cache(layout, 2, seed=12)
    cache.tensor[0][:, [2, 3]] = new[0]  # reuse now, e.g. a local prefill writing its KV
    assert same_bytes(cache.tensor[0][:, [2, 3]], new[0])
    hook.release.set()
    assert poll_events(receiver, 5.0, until=1) == [kt.ReceiveEvent("t1", kt.ReceiveKind.RELEASED)]
    assert not same_bytes(cache.tensor[0][:, [2, 3]], new[0]), "the hazard did not show"
    assert same_bytes(cache.tensor[0][:, [2, 3]], old[0][:, [0, 1]])  # overwritten by the old writer


def _held_sender_process(endpoint: str, ready, block_ids) -> None:
    """Child: an shm sender held forever in its pre_write_hook (the test kills it there)."""
    torch.set_num_threads(1)
    layout = make_layout()

    def hook(header: KVHeader) -> None:
        ready.set()
        time.sleep(3600)

    sender = kt.create_sender("shm", connect_timeout_s=10.0, pre_write_hook=hook)
    sender.connect(endpoint, layout)
    source = source_cache(layout, len(block_ids), seed=13)
    sender.send("k1", 0, 0, source[0], list(range(len(block_ids))))
    time.sleep(3600)


def test_shm_killed_sender_is_fenced_by_its_pid(shm_pair):
    _, receiver, cache, layout = shm_pair()
    receiver.expect("k1", [5, 6], layout.num_layers, 30.0)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_held_sender_process, args=(receiver.endpoint, ready, [5, 6]), daemon=True)
    child.start()
    try:
        assert ready.wait(30), "the child sender never reached its write"
        receiver.cancel("k1")
        assert poll_events(receiver, 0.3) == [], "RELEASED while the writer process lives"
        os.kill(child.pid, signal.SIGKILL)  # not reaped yet: a zombie counts as gone
        events = poll_events(receiver, 5.0, until=1)
        assert events == [kt.ReceiveEvent("k1", kt.ReceiveKind.RELEASED)]
    finally:
        child.kill()
        child.join(10)


def _flipping_copy(monkeypatch, calls: list):
    """shm's copy_crc32c, recording how it was called and flipping one byte of each unit inside
    the real copy loop (copy_crc32c's corrupt_at): after its store, before any read-back."""
    import kvtransfer.shm_backend as shm

    def bad_copy(copies, value=0, verify=True, stream=False):
        calls.append((verify, stream))
        return copy_crc32c(copies, value, verify, corrupt_at=sum(n for _, _, n in copies) // 2, stream=stream)
    monkeypatch.setattr(shm, "copy_crc32c", bad_copy)


@pytest.mark.parametrize("mode, reason, call", [
    ("sender", "does not read back", (True, False)),  # cached stores, read back by the writer
    ("receiver", "checksum mismatch", (False, True)),  # streamed, crc32c'd in place
])
def test_shm_checked_modes_catch_a_bad_write(hosts, monkeypatch, mode, reason, call):
    """verify="sender": the writer compares each copied chunk with its source, and a copy that
    does not read back fails the transfer. verify="receiver": the writer streams (no read-back
    of its own) and the receiver's crc32c of the blocks in place refuses the unit. Either way
    the receiver reports the failure and releases the blocks."""
    host = hosts("shm")
    layout = make_layout()
    key, endpoint = open_receiver(host, verify=mode)
    expect(host, key, "flipped", [3, 4])
    calls: list = []
    _flipping_copy(monkeypatch, calls)
    sender = connected_sender("shm", endpoint, layout)
    send_all(sender, "flipped", source_cache(layout, 2, seed=8), [0, 1], first_token=1)
    status = wait_all(sender, ["flipped"])["flipped"]
    assert status.failed and reason in status.reason
    assert calls and all(c == call for c in calls)
    events = by_transfer(host.call("wait", key, 2, 10.0))
    assert [e[0] for e in events["flipped"]] == [FAILED, RELEASED]
    sender.close()
    host.call("close", key)


def test_shm_default_streams_and_lands(hosts, monkeypatch):
    """verify="copy" (the default): the writer streams its stores past the cache and nobody
    reads them again; the blocks land byte for byte and the transfer completes. (What the mode
    does not check is shown by the same flipped byte going unnoticed.)"""
    import kvtransfer.shm_backend as shm

    host = hosts("shm")
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "good", [3, 4])
    calls: list = []
    monkeypatch.setattr(shm, "copy_crc32c", lambda copies, value=0, verify=True, stream=False:
                        calls.append((verify, stream)) or copy_crc32c(copies, value, verify, stream=stream))
    sender = connected_sender("shm", endpoint, layout)
    src = source_cache(layout, 2, seed=9)
    send_all(sender, "good", src, [0, 1], first_token=2)
    assert wait_all(sender, ["good"])["good"].done
    assert calls and all(c == (False, True) for c in calls)
    cache = host.call("cache", key)
    for layer in range(layout.num_layers):
        assert same_bytes(cache[layer][:, [3, 4]], src[layer][:, [0, 1]])
    expect(host, key, "flipped", [5, 6])
    _flipping_copy(monkeypatch, calls)
    send_all(sender, "flipped", src, [0, 1], first_token=2)
    assert wait_all(sender, ["flipped"])["flipped"].done
    sender.close()
    host.call("close", key)


def test_handshake_carries_the_mode_and_reads_an_old_receiver_as_sender():
    """shm_verify crosses the wire; a receiver that predates the field (empty) reads as
    "sender", what it did then, so its writer keeps reading back."""
    from kvtransfer.message import HandshakeReply
    from kvtransfer.pb import kvtransfer_pb2 as pb

    layout = make_layout()
    for mode in ("copy", "sender", "receiver"):
        reply = HandshakeReply(layout, 8, "seg", "own", 4, mode)
        assert HandshakeReply.decode(reply.encode()).shm_verify == mode
    old = HandshakeReply(layout, 8, "seg", "own", 4).to_pb()
    old.ClearField("shm_verify")
    assert HandshakeReply.decode(old.SerializeToString()).shm_verify == "sender"
    assert pb.HandshakeReply().shm_verify == ""


def test_sender_refuses_an_unknown_mode_before_mapping_anything():
    from kvtransfer.base import KVTransferError
    from kvtransfer.message import HandshakeReply

    layout = make_layout()
    cache = kt.allocate_cache(layout, 4, shared_memory_name=f"{SHM_PREFIX}-mode{next(KEYS)}")
    receiver = kt.create_receiver("shm", cache, layout)
    try:
        sender = kt.create_sender("shm")
        reply = HandshakeReply(layout, 4, cache.shm_name, f"{cache.shm_name}-own", 4, "bogus")
        with pytest.raises(KVTransferError, match="unknown shm check 'bogus'"):
            sender._on_handshake(reply, "ipc://nowhere")
        assert sender._segments == [] and sender._cache is None
        sender.close()
    finally:
        receiver.close()
        cache.close()
