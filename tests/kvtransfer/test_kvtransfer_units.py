"""kvtransfer in one process: layout, messages, checksums, the fence, the registry, and the fake
backend's faults. The contract itself, for every backend, is in test_kvtransfer_backends.py."""

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
from kvtransfer.message import KVHeader, MessageError, block_runs, checksum, checksum_blocks

ROOT = Path(__file__).resolve().parents[2]
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
    back = payload_tensor(h, bytes(raw))  # [layer_count = 1, *payload shape]
    assert back.dtype == torch.bfloat16 and torch.equal(back[0].view(torch.uint8), p.view(torch.uint8))
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
    h = KVHeader.for_payload("r", 1, (4, 9), p, LAYOUT, seq=7, sender_id="s")
    assert KVHeader.decode(h.encode()) == h
    assert h.is_data and not h.is_abort
    fin = KVHeader("r", seq=8, sender_id="s", finish=True, first_token=-3, num_units=12)
    assert KVHeader.decode(fin.encode()) == fin and not fin.is_data
    abort = fin.with_error("prefill failed")
    assert KVHeader.decode(abort.encode()).is_abort
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


def test_checksum_is_crc32c_and_block_checksums_need_no_gather():
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert checksum(b"6789", checksum(b"12345")) == checksum(b"123456789")
    layer = payload(LAYOUT, 10, 1)
    for ids in ([3], [0, 1, 2], [7, 2, 3, 4, 9], [5, 4, 3]):
        assert checksum_blocks(layer, ids) == checksum(layer[:, ids].contiguous())
    assert list(block_runs([7, 2, 3, 4, 9])) == [(7, 7, 1), (2, 2, 3), (9, 9, 1)]
    assert list(block_runs([0, 1, 2, 5], [4, 5, 9, 10])) == [(0, 4, 2), (2, 9, 1), (5, 10, 1)]


def test_fence_sees_live_recycled_and_zombie_processes():
    from kvtransfer.fence import own_identity, process_start_time, same_process_alive

    pid, start = own_identity()
    assert start > 0 and same_process_alive(pid, start)
    assert not same_process_alive(pid, start + 1)  # a recycled pid has another start time
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while process_start_time(child.pid) is not None:  # exits into a zombie: gone already
        time.sleep(0.01)
        if child.poll() is not None:
            break
    child.wait()
    assert process_start_time(child.pid) is None


def test_crc32c_releases_the_gil_on_large_buffers():
    """The reason the I/O threads can checksum beside the engine thread."""
    import threading

    import crc32c

    data = bytes(64 << 20)
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(1)
            time.sleep(0)

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.01)
    before = len(ticks)
    for _ in range(3):
        crc32c.crc32c(data, gil_release_mode=-1)  # -1: release for buffers >= 32 KiB
    during = len(ticks) - before
    done.set()
    t.join()
    assert during > 10, "the other thread did not run while crc32c ran"


# -- fake backend ------------------------------------------------------------------------------


def test_fake_out_of_order_delivery_and_events(fake_pair):
    """A delayed unit arrives after the finish: COMPLETE waits for it."""
    sender, receiver, cache = fake_pair(faults=[FakeFault("delay", layer=1, delay_s=0.3)])
    receiver.expect("r", [2, 5, 7], num_layers=3, deadline_s=5)
    source = torch.stack([payload(LAYOUT, 4, layer) for layer in range(3)])  # a 3-layer cache
    for layer in range(3):
        sender.send("r", layer, 0, source[layer], [0, 1])
        sender.send("r", layer, 2, source[layer], [3])
    sender.finish("r", 77)
    time.sleep(0.1)
    assert receiver.poll() == []  # finish is in, layer 1 is not
    assert wait_status(sender, "r").done
    assert receiver.poll() == [kt.ReceiveEvent("r", kt.ReceiveKind.COMPLETE, first_token=77)]
    for layer in range(3):
        assert torch.equal(cache.tensor[layer][:, [2, 5, 7]], source[layer][:, [0, 1, 3]])
    with pytest.raises(KeyError):
        sender.poll("r")  # a terminal status is reported once


@pytest.mark.parametrize("host_cache", [True, False], ids=["host-cache", "device-cache-path"])
@pytest.mark.parametrize("kind, reason", [("corrupt", "checksum mismatch"), ("fingerprint", "fingerprint mismatch")])
def test_fake_refused_unit_fails_only_its_transfer(fake_pair, kind, reason, host_cache):
    """Both write paths of the receive table: into a host cache (checksum during the write)
    and the one a device cache takes (checksum first, then torch copies), forced here."""
    sender, receiver, cache = fake_pair(faults=[FakeFault(kind, transfer_id="bad", layer=1)])
    receiver.table._host_cache = host_cache
    receiver.expect("good", [0, 1], 3, 5)
    receiver.expect("bad", [2, 3], 3, 5)
    source = payload(LAYOUT, 2, 1)
    for layer in range(3):
        sender.send("good", layer, 0, source, [0, 1])
        sender.send("bad", layer, 0, source, [0, 1])
    sender.finish("good", 1)
    sender.finish("bad", 1)
    assert wait_status(sender, "good").done
    status = wait_status(sender, "bad")
    assert status.failed and reason in status.reason
    events = receiver.poll()
    assert kt.ReceiveEvent("good", kt.ReceiveKind.COMPLETE, first_token=1) in events
    bad = [e for e in events if e.request_id == "bad"]
    assert [e.kind for e in bad] == [kt.ReceiveKind.FAILED, kt.ReceiveKind.RELEASED]
    assert reason in bad[0].reason
    # Later layers never written; the refused layer 1 only when its checksum was checked
    # during the write into this host cache (then in bad's own blocks, which it released).
    first_clean = 2 if kind == "corrupt" and host_cache else 1
    assert not cache.tensor[first_clean:, :, [2, 3]].any()
    for layer in range(3):
        assert torch.equal(cache.tensor[layer][:, [0, 1]], source)


def test_fake_drop_fails_both_sides_by_deadline(fake_pair):
    sender, receiver, _ = fake_pair(faults=[FakeFault("drop", layer=2)], ack_timeout_s=1.0)
    receiver.expect("r", [0], 3, deadline_s=1.5)
    source = payload(LAYOUT, 1, 0)
    for layer in range(3):
        sender.send("r", layer, 0, source, [0])
    sender.finish("r", 0)
    assert sender.poll("r").state is kt.TransferState.IN_FLIGHT
    status = wait_status(sender, "r")
    assert status.failed and "no ack for layers [2]" in status.reason
    [failed, released] = receiver.poll()  # the sender's abort reached the receiver
    assert failed.kind is kt.ReceiveKind.FAILED and "no ack in time" in failed.reason
    assert released.kind is kt.ReceiveKind.RELEASED


def test_fake_slow_transfer_runs_off_the_engine_thread(fake_pair):
    sender, receiver, cache = fake_pair(faults=[FakeFault("slow", delay_s=0.15)])
    receiver.expect("r", [4], 3, 5)
    source = payload(LAYOUT, 1, 0)
    start = time.monotonic()
    for layer in range(3):
        sender.send("r", layer, 0, source, [0])
    sender.finish("r", 2)
    # Had send() or finish() waited for the 0.45 s of transfer, it would be done by now.
    assert sender.poll("r").state is kt.TransferState.IN_FLIGHT
    assert wait_status(sender, "r").done
    assert time.monotonic() - start >= 0.45
    assert receiver.poll() == [kt.ReceiveEvent("r", kt.ReceiveKind.COMPLETE, first_token=2)]


def test_fake_no_grant_fails_by_ack_timeout_and_receiver_deadline(fake_pair):
    sender, receiver, _ = fake_pair(faults=[FakeFault("no_grant", transfer_id="r")], ack_timeout_s=0.5)
    receiver.expect("r", [0], 3, deadline_s=3)
    sender.send("r", 0, 0, payload(LAYOUT, 1, 0), [0])
    status = wait_status(sender, "r")
    assert status.failed and "no grant for r within 0.5s" in status.reason
    [failed, released] = receiver.poll()  # the sender told the receiver it gave up
    assert (failed.kind, released.kind) == (kt.ReceiveKind.FAILED, kt.ReceiveKind.RELEASED)


def test_fake_expect_and_send_argument_checks(fake_pair):
    sender, receiver, _ = fake_pair()
    receiver.expect("r", [0, 1], 3, 5)
    with pytest.raises(ValueError, match="blocks \\[1\\] expected by r"):
        receiver.expect("r2", [1, 2], 3, 5)
    with pytest.raises(ValueError, match="already expected"):
        receiver.expect("r", [5], 3, 5)
    with pytest.raises(ValueError, match="duplicate"):
        receiver.expect("r3", [5, 5], 3, 5)
    with pytest.raises(ValueError, match="out of range"):
        receiver.expect("r4", [99], 3, 5)
    with pytest.raises(ValueError, match="num_layers"):
        receiver.expect("r5", [9], 4, 5)
    with pytest.raises(ValueError, match="skip_blocks"):
        receiver.expect("r6", [9], 3, 5, skip_blocks=-1)
    source = payload(LAYOUT, 4, 0)
    with pytest.raises(ValueError, match="source shape"):
        sender.send("x", 0, 0, source[0], [0])
    with pytest.raises(ValueError, match="source dtype"):
        sender.send("x", 0, 0, source.half(), [0])
    with pytest.raises(ValueError, match="out of range"):
        sender.send("x", 0, 0, source, [4])
    with pytest.raises(ValueError, match="layer 3"):
        sender.send("x", 3, 0, source, [0])
    with pytest.raises(ValueError, match="first_block"):
        sender.send("x", 0, -1, source, [0])
    with pytest.raises(ValueError, match="empty"):
        sender.send("x", 0, 0, source, [])
    with pytest.raises(KeyError):
        sender.poll("never-sent")


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
        sender.send("r", 0, 0, payload(LAYOUT, 1, 0), [0])
    sender.close()
    receiver.close()
