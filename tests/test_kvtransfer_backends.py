"""zmq, shm and grpc with the receiver in a separate (spawned) process.

Each backend gets one long-lived receiver-host process that the tests drive through a pipe
(open a receiver, expect, cancel, wait for events, read the cache back); the test process is
the sender. Receiver death uses a host of its own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import zmq

import kvtransfer as kt
from kvtransfer.message import KVHeader, tensor_bytes

BACKENDS = ["zmq", "shm", "grpc"]
SHM_PREFIX = f"tkvt{os.getpid()}"
HOST_PIDS: list[int] = []  # receiver hosts started here, for the leak check


def make_layout(dtype: str = "float32", model_id: str = "tiny") -> kt.KVLayout:
    return kt.KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype, model_id=model_id)


def payload(layout: kt.KVLayout, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.payload_shape(n), generator=g).to(layout.torch_dtype)


# -- the receiver host (runs in the child) -----------------------------------------------------


def _host(conn, backend: str, tmp: str) -> None:
    torch.set_num_threads(1)
    receivers: dict[str, tuple[kt.KVReceiver, kt.KVCacheBuffer]] = {}
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                return
            if cmd == "die":
                os._exit(1)
            if cmd == "open":
                key, dtype, num_blocks = args
                layout = make_layout(dtype)
                shm_name = f"{SHM_PREFIX}-{key}" if backend == "shm" else None
                cache = kt.allocate_cache(layout, num_blocks, shared_memory_name=shm_name)
                kw = {"endpoint": f"ipc://{tmp}/{key}.sock"} if backend in ("shm", "zmq") and key.startswith("ipc") else {}
                receiver = kt.create_receiver(backend, cache, layout, **kw)
                receivers[key] = (receiver, cache)
                conn.send(receiver.endpoint)
            elif cmd == "expect":
                key, rid, blocks, num_layers, deadline_s = args
                receivers[key][0].expect(rid, blocks, num_layers, deadline_s)
                conn.send(None)
            elif cmd == "cancel":
                receivers[args[0]][0].cancel(args[1])
                conn.send(None)
            elif cmd == "wait":  # poll until n events or timeout
                key, n, timeout = args
                events, deadline = [], time.monotonic() + timeout
                while len(events) < n and time.monotonic() < deadline:
                    events += receivers[key][0].poll()
                    time.sleep(0.005)
                conn.send([(e.request_id, e.kind.value, e.reason) for e in events])
            elif cmd == "cache":
                conn.send(receivers[args[0]][1].tensor.clone())
            elif cmd == "close":
                receiver, cache = receivers.pop(args[0])
                receiver.close()
                cache.close()
                conn.send(None)
    finally:
        for receiver, cache in receivers.values():
            receiver.close()
            cache.close()


class Host:
    def __init__(self, backend: str, tmp: Path) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host, args=(child, backend, str(tmp)), daemon=True)
        self.proc.start()
        HOST_PIDS.append(self.proc.pid)
        self.backend = backend

    def call(self, *msg, timeout: float = 20.0):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise AssertionError(f"receiver host did not answer {msg[0]} within {timeout}s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module", autouse=True)
def no_leaks():
    import tempfile

    yield
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)]
    assert not leaked, f"shared memory leaked: {leaked}"
    ours = tuple(f"tandem-kv-shm-{pid}-" for pid in HOST_PIDS)
    sockets = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(ours)]
    assert not sockets, f"ipc socket files leaked: {sockets}"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    made: dict[str, Host] = {}

    def get(backend: str) -> Host:
        if backend not in made:
            made[backend] = Host(backend, tmp_path_factory.mktemp(backend))
        return made[backend]

    yield get
    for host in made.values():
        host.stop()


_keys = iter(range(10**6))


def open_receiver(host: Host, dtype: str = "float32", num_blocks: int = 32, ipc: bool = False):
    key = f"{'ipc' if ipc else 'k'}{next(_keys)}"
    return key, host.call("open", key, dtype, num_blocks)


def connected_sender(backend: str, endpoint: str, layout: kt.KVLayout, ack_timeout_s: float = 10.0) -> kt.KVSender:
    sender = kt.create_sender(backend, ack_timeout_s=ack_timeout_s, connect_timeout_s=10.0)
    sender.connect(endpoint, layout)
    return sender


def wait_all(sender: kt.KVSender, rids, timeout: float = 10.0) -> dict[str, kt.TransferStatus]:
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < len(rids) and time.monotonic() < deadline:
        for rid in rids:
            if rid not in out:
                status = sender.poll(rid)
                if status.state is not kt.TransferState.IN_FLIGHT:
                    out[rid] = status
        time.sleep(0.005)
    assert len(out) == len(rids), f"still in flight after {timeout}s: {set(rids) - set(out)}"
    return out


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_requests_delivered_bit_exact(hosts, backend, dtype):
    host = hosts(backend)
    layout = make_layout(dtype)
    key, endpoint = open_receiver(host, dtype, ipc=(backend == "zmq" and dtype == "bfloat16"))
    plan = {"a": [3, 4, 5], "b": [10, 0], "c": [31, 20, 21, 22]}
    for rid, blocks in plan.items():
        host.call("expect", key, rid, blocks, layout.num_layers, 20.0)
    sender = connected_sender(backend, endpoint, layout)
    sent = {}
    for layer in range(layout.num_layers):  # interleaved, as a batched prefill would send
        for i, (rid, blocks) in enumerate(plan.items()):
            if rid == "c":  # chunked prefill: c arrives in two pieces per layer
                for j, part in enumerate((blocks[:1], blocks[1:])):
                    sent[rid, layer, j] = (part, payload(layout, len(part), 100 * layer + 10 * i + j))
                    sender.send(rid, layer, part, sent[rid, layer, j][1])
            else:
                sent[rid, layer, 0] = (blocks, payload(layout, len(blocks), 100 * layer + 10 * i))
                sender.send(rid, layer, blocks, sent[rid, layer, 0][1])
    statuses = wait_all(sender, list(plan))
    assert all(s.done for s in statuses.values()), statuses
    events = host.call("wait", key, 3, 10.0)
    assert sorted(events) == [(rid, "complete", "") for rid in sorted(plan)]
    cache = host.call("cache", key)
    for (rid, layer, _), (blocks, p) in sent.items():
        got = cache[layer][:, blocks]
        assert torch.equal(got.view(torch.uint8), p.view(torch.uint8)), (rid, layer)
    used = {b for blocks in plan.values() for b in blocks}
    assert not cache[:, :, [b for b in range(32) if b not in used]].any()
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
def test_unexpected_request_and_foreign_blocks_refused(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    host.call("expect", key, "r", [0, 1], layout.num_layers, 20.0)
    host.call("expect", key, "ok", [2], layout.num_layers, 20.0)
    host.call("expect", key, "victim", [9], layout.num_layers, 20.0)
    sender = connected_sender(backend, endpoint, layout)
    sender.send("ghost", 0, [5], payload(layout, 1, 0))
    sender.send("r", 0, [1, 9], payload(layout, 2, 1))  # 9 belongs to "victim"
    for layer in range(layout.num_layers):
        sender.send("ok", layer, [2], payload(layout, 1, 10 + layer))
    statuses = wait_all(sender, ["ghost", "r", "ok"])
    assert statuses["ok"].done
    assert statuses["ghost"].failed and "ghost" in statuses["ghost"].reason
    assert statuses["r"].failed and "[9]" in statuses["r"].reason
    events = {rid: (kind, reason) for rid, kind, reason in host.call("wait", key, 3, 10.0)}
    assert events["ok"] == ("complete", "")
    assert events["ghost"][0] == "failed" and "ghost" in events["ghost"][1]
    assert events["r"][0] == "failed" and "[9]" in events["r"][1]
    cache = host.call("cache", key)
    assert not cache[:, :, [0, 1, 5, 9]].any(), "a refused payload reached the cache"
    sender.close()
    host.call("close", key)


def _craft_corrupt(backend: str, endpoint: str, layout: kt.KVLayout, rid: str, block: int) -> str:
    """Push one layer whose bytes do not match the header's checksum, bypassing our sender."""
    p = payload(layout, 1, 99)
    header = KVHeader.for_payload(rid, 0, (block,), p, layout, seq=1)
    data = bytearray(tensor_bytes(p))
    data[5] ^= 0x40
    if backend == "grpc":
        import grpc

        from kvtransfer.pb import kvtransfer_pb2 as pb
        from kvtransfer.pb import kvtransfer_pb2_grpc as pb_grpc

        with grpc.insecure_channel(endpoint) as channel:
            ack = pb_grpc.KVTransferStub(channel).Push(iter([pb.PushChunk(header=header.to_pb(), data=bytes(data))]), timeout=10)
        return ack.reason
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    if backend == "shm":  # header only; claim a checksum that the block in place cannot have
        from dataclasses import replace

        sock.send_multipart([b"N", replace(header, checksum=header.checksum ^ 1).encode()])
    else:
        sock.send_multipart([b"D", header.encode(), bytes(data)])
    assert sock.poll(10_000), "no ack for the crafted frame"
    kind, body = sock.recv_multipart()
    sock.close()
    ctx.term()
    from kvtransfer.message import Ack

    ack = Ack.decode(body)
    assert kind == b"A" and not ack.ok
    return ack.reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_payload_fails_only_that_request(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    host.call("expect", key, "good", [0], layout.num_layers, 20.0)
    host.call("expect", key, "bad", [1], layout.num_layers, 20.0)
    reason = _craft_corrupt(backend, endpoint, layout, "bad", 1)
    assert "checksum mismatch" in reason
    sender = connected_sender(backend, endpoint, layout)
    for layer in range(layout.num_layers):
        sender.send("good", layer, [0], payload(layout, 1, layer))
    assert wait_all(sender, ["good"])["good"].done
    events = {rid: (kind, reason) for rid, kind, reason in host.call("wait", key, 2, 10.0)}
    assert events["good"] == ("complete", "")
    assert events["bad"][0] == "failed" and "checksum mismatch" in events["bad"][1]
    if backend != "shm":  # shm writes are one-sided: the receiver refuses to accept, not to land
        assert not host.call("cache", key)[:, :, 1].any()
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deadline_expiry_and_cancel(hosts, backend):
    host = hosts(backend)
    layout = make_layout()
    key, endpoint = open_receiver(host)
    host.call("expect", key, "slow", [0], layout.num_layers, 0.3)
    host.call("expect", key, "gone", [1], layout.num_layers, 20.0)
    sender = connected_sender(backend, endpoint, layout)
    sender.send("slow", 0, [0], payload(layout, 1, 0))
    sender.send("gone", 0, [1], payload(layout, 1, 1))
    assert all(s.done for s in wait_all(sender, ["slow", "gone"]).values())
    [(rid, kind, reason)] = host.call("wait", key, 1, 5.0)
    assert (rid, kind) == ("slow", "failed") and "deadline passed with 1/4 layers" in reason
    host.call("cancel", key, "gone")
    for layer in range(1, layout.num_layers):
        sender.send("gone", layer, [1], payload(layout, 1, 10 + layer))
    status = wait_all(sender, ["gone"])["gone"]
    assert status.failed and "cancelled" in status.reason
    assert host.call("wait", key, 1, 0.3) == []  # cancel yields no event
    cache = host.call("cache", key)
    assert cache[0, :, 1].any() and not cache[1:, :, 1].any()
    sender.close()
    host.call("close", key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_death_fails_sender_after_deadline(tmp_path, backend):
    host = Host(backend, tmp_path)
    layout = make_layout()
    key = endpoint = ""
    try:
        key, endpoint = open_receiver(host)
        host.call("expect", key, "r", [0], layout.num_layers, 20.0)
        sender = connected_sender(backend, endpoint, layout, ack_timeout_s=1.0)
        host.conn.send(("die",))
        host.proc.join(10)
        assert not host.proc.is_alive()
        start = time.monotonic()
        for layer in range(layout.num_layers):
            sender.send("r", layer, [0], payload(layout, 1, layer))
        status = wait_all(sender, ["r"], timeout=5.0)["r"]
        assert status.failed, status
        assert time.monotonic() - start < 3.0
        sender.close()
    finally:
        host.stop()
        for name in (f"{SHM_PREFIX}-{key}", f"{SHM_PREFIX}-{key}-own"):
            if os.path.exists(f"/dev/shm/{name}"):  # the dead receiver could not unlink them
                os.unlink(f"/dev/shm/{name}")
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            os.unlink(endpoint[6:])
