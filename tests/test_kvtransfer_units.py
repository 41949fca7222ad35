"""kvtransfer in one process: layout, messages, the registry, and the fake backend's faults."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kvtransfer as kt
from kvtransfer.fake import FakeFault, FakeSender
from kvtransfer.message import KVHeader, MessageError, checksum

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = kt.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", model_id="tiny")


def payload(layout: kt.KVLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.payload_shape(n), generator=g).to(layout.torch_dtype)


def wait_status(sender: kt.KVSender, rid: str, timeout: float = 5.0) -> kt.TransferStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = sender.poll(rid)
        if status.state is not kt.TransferState.IN_FLIGHT:
            return status
        time.sleep(0.01)
    raise AssertionError(f"{rid} still in flight after {timeout}s")


@pytest.fixture
def fake_pair():
    made = []

    def make(layout=LAYOUT, num_blocks=16, **sender_kw):
        cache = kt.allocate_cache(layout, num_blocks)
        receiver = kt.create_receiver("fake", cache, layout)
        sender = kt.create_sender("fake", **sender_kw)
        sender.connect(receiver.endpoint, layout)
        made.append((sender, receiver))
        return sender, receiver, cache

    yield make
    for sender, receiver in made:
        sender.close()
        receiver.close()


# -- layout ------------------------------------------------------------------------------------


def test_layout_validates_and_fingerprints():
    assert LAYOUT.fingerprint == kt.KVLayout(3, 2, 8, 4, "float32", "tiny").fingerprint
    other = kt.KVLayout(3, 2, 8, 4, "bfloat16", "tiny")
    assert other.fingerprint != LAYOUT.fingerprint
    assert LAYOUT.diff(other) == ["dtype: 'float32' != 'bfloat16'"]
    assert LAYOUT.bytes_per_block_per_layer() == 2 * 4 * 2 * 8 * 4
    assert other.bytes_per_block_per_layer() == 2 * 4 * 2 * 8 * 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        kt.KVLayout(3, 0, 8, 4, "float32", "tiny")
    with pytest.raises(ValueError, match="dtype"):
        kt.KVLayout(3, 2, 8, 4, "int8", "tiny")
    with pytest.raises(ValueError, match="model_id"):
        kt.KVLayout(3, 2, 8, 4, "float32", "")


def test_bf16_layout_halves_the_wire_and_describes_its_dtype():
    from kvtransfer.message import payload_tensor, tensor_bytes

    bf16 = replace(LAYOUT, dtype="bfloat16")
    assert bf16.description.startswith("bfloat16 ") and bf16.description.endswith(bf16.fingerprint)
    assert LAYOUT.description.startswith("float32 ") and LAYOUT.description != bf16.description
    assert 2 * bf16.payload_nbytes(3) == LAYOUT.payload_nbytes(3)
    assert 2 * bf16.cache_nbytes(5) == LAYOUT.cache_nbytes(5)
    p = payload(bf16, 3, 0)
    raw = tensor_bytes(p)  # bf16 has no numpy dtype: the bytes go through a uint8 view
    assert len(raw) == bf16.payload_nbytes(3)
    h = KVHeader.for_payload("r", 0, (1, 2, 3), p, bf16, 0)
    assert (h.dtype, h.payload_nbytes) == ("bfloat16", bf16.payload_nbytes(3))
    h.check_against(bf16, 16)
    with pytest.raises(MessageError, match="fingerprint mismatch"):
        h.check_against(LAYOUT, 16)
    back = payload_tensor(h, bytes(raw))
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.uint8), p.view(torch.uint8))
    assert kt.dtype_name(torch.bfloat16) == "bfloat16" and kt.dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="no KV layout dtype"):
        kt.dtype_name(torch.int8)


def test_allocate_cache_in_shared_memory_and_unlink():
    name = f"tkvu-{os.getpid()}"
    cache = kt.allocate_cache(LAYOUT, 8, shared_memory_name=name)
    assert cache.tensor.shape == LAYOUT.cache_shape(8) and not cache.tensor.any()
    assert os.path.exists(f"/dev/shm/{name}")
    from kvtransfer.layout import AttachedSegment, map_shared_tensor

    seg = AttachedSegment(name)
    view = map_shared_tensor(seg, torch.float32, LAYOUT.cache_shape(8))
    view[1, 0, 3].fill_(7.0)  # another mapping of the same memory
    assert bool((cache.tensor[1, 0, 3] == 7.0).all())
    del view
    seg.close()
    cache.close()
    cache.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")


# -- messages ----------------------------------------------------------------------------------


def test_header_roundtrip_and_named_mismatches():
    p = payload(LAYOUT, 2, 0)
    h = KVHeader.for_payload("r", 1, (4, 9), p, LAYOUT, seq=7)
    assert KVHeader.decode(h.encode()) == h
    assert h.checksum == checksum(p)
    h.check_against(LAYOUT, 16)
    other = kt.KVLayout(3, 2, 8, 4, "float32", "other-model")
    with pytest.raises(MessageError, match="fingerprint mismatch"):
        h.check_against(other, 16)
    with pytest.raises(MessageError, match=r"block ids \[9\] out of range"):
        h.check_against(LAYOUT, 9)
    from dataclasses import replace

    with pytest.raises(MessageError, match="shape mismatch"):
        replace(h, shape=(2, 2, 4, 2, 4)).check_against(LAYOUT, 16)
    with pytest.raises(MessageError, match="dtype mismatch"):
        replace(h, dtype="float16").check_against(LAYOUT, 16)
    with pytest.raises(MessageError, match="duplicate"):
        replace(h, block_ids=(4, 4)).check_against(LAYOUT, 16)
    with pytest.raises(MessageError, match="undecodable"):
        KVHeader.decode(b"\xff\xff\xff")


def test_generated_stubs_are_current(tmp_path):
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    subprocess.run([sys.executable, str(tmp_path / "proto" / "generate.py")], check=True, capture_output=True)
    names = sorted(p.name for p in (ROOT / "kvtransfer" / "pb").iterdir() if p.is_file())
    match, mismatch, errors = filecmp.cmpfiles(ROOT / "kvtransfer" / "pb", tmp_path / "kvtransfer" / "pb", names, shallow=False)
    assert not mismatch and not errors, f"stale stubs: run proto/generate.py ({mismatch + errors})"
    assert "from . import kvtransfer_pb2" in (tmp_path / "kvtransfer/pb/kvtransfer_pb2_grpc.py").read_text()


# -- registry ----------------------------------------------------------------------------------


def test_registry_is_lazy_and_model_agnostic():
    with pytest.raises(ValueError, match="unknown KV transfer backend 'nccl2'"):
        kt.create_sender("nccl2")
    code = (
        "import sys, kvtransfer as kt; kt.create_sender('fake');"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('zmq', 'grpc', 'engine', 'coordinator', 'prefill_node', 'decode_node')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- fake backend ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fake_chunked_delivery_completes_only_when_every_block_arrived(fake_pair, dtype):
    layout = replace(LAYOUT, dtype=dtype)
    sender, receiver, cache = fake_pair(layout)
    receiver.expect("r", [2, 5, 7], num_layers=3, deadline_s=5)
    parts = {}
    for layer in range(3):  # chunk 1: blocks 2, 5
        parts[layer, 0] = payload(layout, 2, layer)
        sender.send("r", layer, [2, 5], parts[layer, 0])
    assert receiver.poll() == []
    for layer in range(3):  # chunk 2: block 7
        parts[layer, 1] = payload(layout, 1, 10 + layer)
        sender.send("r", layer, [7], parts[layer, 1])
    assert receiver.poll() == [kt.ReceiveEvent("r", kt.ReceiveKind.COMPLETE)]
    assert sender.poll("r").done
    assert cache.tensor.dtype == layout.torch_dtype
    for layer in range(3):  # bit-exact: compare the raw bytes
        assert torch.equal(cache.tensor[layer][:, [2, 5]].view(torch.uint8), parts[layer, 0].view(torch.uint8))
        assert torch.equal(cache.tensor[layer][:, [7]].view(torch.uint8), parts[layer, 1].view(torch.uint8))
    untouched = [b for b in range(16) if b not in (2, 5, 7)]
    assert not cache.tensor[:, :, untouched].any()
    with pytest.raises(KeyError):
        sender.poll("r")  # a terminal status is reported once


@pytest.mark.parametrize("kind, reason", [("corrupt", "checksum mismatch"), ("fingerprint", "fingerprint mismatch")])
def test_fake_refused_payload_fails_only_its_request(fake_pair, kind, reason):
    sender, receiver, cache = fake_pair(faults=[FakeFault(kind, request_id="bad", layer=1)])
    receiver.expect("good", [0, 1], 3, 5)
    receiver.expect("bad", [2, 3], 3, 5)
    for layer in range(3):
        sender.send("good", layer, [0, 1], payload(LAYOUT, 2, layer))
        sender.send("bad", layer, [2, 3], payload(LAYOUT, 2, 10 + layer))
    events = {e.request_id: e for e in receiver.poll()}
    assert events["good"].kind is kt.ReceiveKind.COMPLETE
    assert events["bad"].kind is kt.ReceiveKind.FAILED and reason in events["bad"].reason
    assert sender.poll("good").done
    status = sender.poll("bad")
    assert status.failed and reason in status.reason
    assert not cache.tensor[1:, :, [2, 3]].any()  # the refused layer and later ones never written


def test_fake_drop_fails_both_sides_by_deadline(fake_pair):
    sender, receiver, _ = fake_pair(faults=[FakeFault("drop", layer=2)], ack_timeout_s=1.5)
    receiver.expect("r", [0], 3, deadline_s=1.0)  # passed by the time the sender gives up
    for layer in range(3):
        sender.send("r", layer, [0], payload(LAYOUT, 1, layer))
    assert sender.poll("r").state is kt.TransferState.IN_FLIGHT
    status = wait_status(sender, "r")
    assert status.failed and "no ack for layers [2]" in status.reason
    time.sleep(0.05)
    [event] = receiver.poll()
    assert event.kind is kt.ReceiveKind.FAILED and "deadline" in event.reason and "2/3" in event.reason


def test_fake_delay_delivers_late(fake_pair):
    sender, receiver, cache = fake_pair(faults=[FakeFault("delay", delay_s=1.0)])
    receiver.expect("r", [4], 1, 5)
    p = payload(LAYOUT, 1, 0)
    sender.send("r", 0, [4], p)
    assert receiver.poll() == [] and sender.poll("r").state is kt.TransferState.IN_FLIGHT
    assert wait_status(sender, "r").done
    assert receiver.poll() == [kt.ReceiveEvent("r", kt.ReceiveKind.COMPLETE)]
    assert torch.equal(cache.tensor[0][:, [4]], p)


def test_fake_unexpected_foreign_cancel_and_bad_arguments(fake_pair):
    sender, receiver, cache = fake_pair()
    receiver.expect("r", [0, 1], 3, 5)
    sender.send("ghost", 0, [5], payload(LAYOUT, 1, 0))
    sender.send("r", 0, [1, 6], payload(LAYOUT, 2, 1))  # block 6 is not r's
    events = {e.request_id: e.reason for e in receiver.poll()}
    assert "unexpected request ghost" in events["ghost"]
    assert "blocks [6] are not owned by request r" in events["r"]
    assert "unexpected" in sender.poll("ghost").reason and sender.poll("r").failed
    assert not cache.tensor.any()

    receiver.expect("c", [2], 3, 5)
    sender.send("c", 0, [2], payload(LAYOUT, 1, 2))
    receiver.cancel("c")
    sender.send("c", 1, [2], payload(LAYOUT, 1, 3))
    assert receiver.poll() == []
    assert "cancelled" in sender.poll("c").reason
    assert cache.tensor[0, :, 2].any() and not cache.tensor[1:, :, 2].any()

    with pytest.raises(ValueError, match="already expected by r2"):
        receiver.expect("r2", [7], 3, 5)
        receiver.expect("r3", [7, 8], 3, 5)
    with pytest.raises(ValueError, match="out of range"):
        receiver.expect("r4", [99], 3, 5)
    with pytest.raises(ValueError, match="num_layers"):
        receiver.expect("r5", [9], 4, 5)
    with pytest.raises(ValueError, match="payload shape"):
        sender.send("x", 0, [9, 10], payload(LAYOUT, 1, 0))
    with pytest.raises(ValueError, match="payload dtype"):
        sender.send("x", 0, [9], payload(LAYOUT, 1, 0).half())


def test_fake_layout_mismatch_refused_at_connect():
    cache = kt.allocate_cache(LAYOUT, 4)
    receiver = kt.create_receiver("fake", cache, LAYOUT)
    sender = FakeSender()
    other = kt.KVLayout(3, 2, 8, 8, "float32", "tiny")
    with pytest.raises(kt.KVLayoutMismatch, match="block_size: 8 != 4"):
        sender.connect(receiver.endpoint, other)
    with pytest.raises(kt.KVLayoutMismatch, match="dtype: 'bfloat16' != 'float32'"):
        sender.connect(receiver.endpoint, replace(LAYOUT, dtype="bfloat16"))
    with pytest.raises(kt.KVTransferError, match="before connect"):
        sender.send("r", 0, [0], payload(other, 1, 0))
    receiver.close()
