"""Every backend (fake, zmq, shm, grpc) through one parametrized suite of the contract in
kvtransfer/base.py, plus the shm block-reuse race made deterministic.

zmq, shm and grpc receivers live in a spawned host process per backend, driven through a pipe
(open a receiver, expect, cancel, wait for events, read the cache back); the fake's lives in
this process behind the same interface. The test process is the sender. Units that no honest
sender would send (bad checksum, foreign blocks) come from `RawClient`, which speaks each
backend's wire protocol by hand.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

import kvtransfer as kt
from kvtransfer.message import (
    Ack, Grant, GrantRequest, HandshakeRequest, KVHeader, tensor_bytes,
)

BACKENDS = ["fake", "zmq", "shm", "grpc"]
SHM_PREFIX = f"tkvt{os.getpid()}"
HOST_PIDS: list[int] = []  # receiver hosts started here, for the leak check
COMPLETE, FAILED, RELEASED = "complete", "failed", "released"


def make_layout(dtype: str = "float32", model_id: str = "tiny") -> kt.KVLayout:
    return kt.KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype, model_id=model_id)


def source_cache(layout: kt.KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """A prefill worker's cache: [num_layers, 2, num_blocks, block_size, heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.cache_shape(num_blocks), generator=g).to(layout.torch_dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- the receiver host ---------------------------------------------------------------------------


class Receivers:
    """The commands a test sends to its receivers; runs in the host process (or in-process)."""

    def __init__(self, backend: str, tmp: str) -> None:
        self.backend, self.tmp = backend, tmp
        self.receivers: dict[str, tuple[kt.KVReceiver, kt.KVCacheBuffer]] = {}

    def handle(self, cmd: str, *args):
        if cmd == "open":
            key, dtype, num_blocks, options = args
            layout = make_layout(dtype)
            shm_name = f"{SHM_PREFIX}-{key}" if self.backend == "shm" else None
            cache = kt.allocate_cache(layout, num_blocks, shared_memory_name=shm_name)
            kw = ({"endpoint": f"ipc://{self.tmp}/{key}.sock"}
                  if self.backend in ("shm", "zmq") and key.startswith("ipc") else {})
            receiver = kt.create_receiver(self.backend, cache, layout, **kw, **options)
            self.receivers[key] = (receiver, cache)
            return receiver.endpoint
        receiver, cache = self.receivers[args[0]]
        if cmd == "expect":
            _, rid, blocks, num_layers, deadline_s, skip = args
            receiver.expect(rid, blocks, num_layers, deadline_s, skip_blocks=skip)
            return None
        if cmd == "cancel":
            receiver.cancel(args[1])
            return None
        if cmd == "wait":  # poll until n events or timeout
            _, n, timeout = args
            events, deadline = [], time.monotonic() + timeout
            while len(events) < n and time.monotonic() < deadline:
                events += receiver.poll()
                time.sleep(0.005)
            return [(e.request_id, e.kind.value, e.reason, e.first_token) for e in events]
        if cmd == "cache":
            return cache.tensor.clone()
        if cmd == "stats":
            return receiver.stats()
        if cmd == "close":
            del self.receivers[args[0]]
            receiver.close()
            cache.close()
            return None
        raise ValueError(cmd)

    def close_all(self) -> None:
        for receiver, cache in self.receivers.values():
            receiver.close()
            cache.close()
        self.receivers.clear()


def _host(conn, backend: str, tmp: str) -> None:
    torch.set_num_threads(1)
    receivers = Receivers(backend, tmp)
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                return
            if cmd == "die":
                os._exit(1)
            conn.send(receivers.handle(cmd, *args))
    finally:
        receivers.close_all()


class Host:
    """A receiver host process."""

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

    def die(self) -> None:
        self.conn.send(("die",))
        self.proc.join(10)
        assert not self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class LocalHost:
    """The fake backend's receivers, in this process, behind Host's interface."""

    def __init__(self, tmp: Path) -> None:
        self.receivers = Receivers("fake", str(tmp))
        self.backend = "fake"

    def call(self, *msg, timeout: float = 20.0):
        return self.receivers.handle(*msg)

    def die(self) -> None:
        for receiver, _ in self.receivers.receivers.values():
            receiver.close()

    def stop(self) -> None:
        self.receivers.close_all()


def make_host(backend: str, tmp: Path) -> Host | LocalHost:
    return LocalHost(tmp) if backend == "fake" else Host(backend, tmp)


@pytest.fixture(scope="module", autouse=True)
def no_leaks():
    yield
    leaked = [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)]
    assert not leaked, f"shared memory leaked: {leaked}"
    ours = tuple(f"tandem-kv-shm-{pid}-" for pid in (*HOST_PIDS, os.getpid()))
    sockets = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(ours)]
    assert not sockets, f"ipc socket files leaked: {sockets}"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    made: dict[str, Host | LocalHost] = {}

    def get(backend: str) -> Host | LocalHost:
        if backend not in made:
            made[backend] = make_host(backend, tmp_path_factory.mktemp(backend))
        return made[backend]

    yield get
    for host in made.values():
        host.stop()


_keys = iter(range(10**6))


def open_receiver(host, dtype: str = "float32", num_blocks: int = 32, ipc: bool = False, **options):
    key = f"{'ipc' if ipc else 'k'}{next(_keys)}"
    return key, host.call("open", key, dtype, num_blocks, options)


def expect(host, key, rid, blocks, deadline_s: float = 20.0, skip: int = 0, num_layers: int = 4):
    host.call("expect", key, rid, blocks, num_layers, deadline_s, skip)


def connected_sender(backend: str, endpoint: str, layout: kt.KVLayout, ack_timeout_s: float = 10.0,
                     **kw) -> kt.KVSender:
    sender = kt.create_sender(backend, ack_timeout_s=ack_timeout_s, connect_timeout_s=10.0, **kw)
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


def send_all(sender, rid, source, src_ids, first_block=0, layers=range(4), first_token=None):
    for layer in layers:
        sender.send(rid, layer, first_block, source[layer], src_ids)
    if first_token is not None:
        sender.finish(rid, first_token)


def by_transfer(events) -> dict[str, list[tuple[str, str, int | None]]]:
    out: dict[str, list] = {}
    for rid, kind, reason, token in events:
        out.setdefault(rid, []).append((kind, reason, token))
    return out


# -- a hand-driven client for units no honest sender sends ----------------------------------------


class RawClient:
    """Speaks a backend's protocol by hand: handshake, ask, then arbitrary units."""

    def __init__(self, backend: str, host, key: str, endpoint: str, layout: kt.KVLayout) -> None:
        self.backend, self.layout, self.sender_id = backend, layout, f"raw-{next(_keys)}"
        hello = HandshakeRequest(layout, self.sender_id)
        if backend == "fake":
            self.table = host.receivers.receivers[key][0].table
            self.table.register_sender(hello)
        elif backend == "grpc":
            import grpc

            from kvtransfer.pb import kvtransfer_pb2_grpc as pb_grpc

            self.channel = grpc.insecure_channel(endpoint)
            self.stub = pb_grpc.KVTransferStub(self.channel)
            self.stub.Handshake(hello.to_pb(), timeout=10, wait_for_ready=True)
        else:
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(endpoint)
            self.sock.send_multipart([b"H", hello.encode()])
            assert self.recv(b"W")

    def recv(self, kind: bytes) -> bytes:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                if frames[0] == kind:
                    return frames[-1]
        raise AssertionError(f"no {kind!r} frame within 10s")

    def ask(self, rid: str) -> Grant:
        if self.backend == "fake":
            self.table.ask(self.sender_id, rid)  # the grant goes nowhere; the table knows us
            return Grant(rid, True)
        if self.backend == "grpc":
            return Grant.from_pb(self.stub.Grant(GrantRequest(rid, self.sender_id).to_pb(), timeout=10))
        self.sock.send_multipart([b"G", GrantRequest(rid, self.sender_id).encode()])
        return Grant.decode(self.recv(b"g"))

    def unit(self, header: KVHeader, data: bytes | None) -> Ack:
        """A data unit; data None = shm's notification that the blocks are written in place."""
        from dataclasses import replace

        header = replace(header, sender_id=self.sender_id)
        if self.backend == "fake":
            return self.table.ingest(header, data)
        if self.backend == "grpc":
            from kvtransfer.pb import kvtransfer_pb2 as pb

            chunk = pb.PushChunk(header=header.to_pb(), data=data or b"")
            return Ack.from_pb(self.stub.Push(iter([chunk]), timeout=10))
        if data is None:
            self.sock.send_multipart([b"N", header.encode()])
        else:
            self.sock.send_multipart([b"D", header.encode(), data])
        return Ack.decode(self.recv(b"A"))

    def abort(self, rid: str) -> None:
        header = KVHeader(rid, sender_id=self.sender_id, sender_error="raw client gives up")
        if self.backend == "fake":
            self.table.control(header)
        elif self.backend == "grpc":
            from kvtransfer.pb import kvtransfer_pb2 as pb

            self.stub.Push(iter([pb.PushChunk(header=header.to_pb())]), timeout=10)
        else:
            self.sock.send_multipart([b"C", header.encode()])

    def close(self) -> None:
        if self.backend == "grpc":
            self.channel.close()
        elif self.backend != "fake":
            self.sock.close()
            self.ctx.term()


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
    assert stats.backend == backend and stats.transfers_done == 3 and stats.units == 16
    assert stats.bytes == 4 * 9 * layout.bytes_per_block_per_layer() and stats.seconds > 0
    rstats = host.call("stats", key)
    assert (rstats.bytes, rstats.units, rstats.transfers_done) == (stats.bytes, 16, 3)
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
    assert all(s.done for s in wait_all(sender, ["p", "all"]).values())
    events = sorted(host.call("wait", key, 2, 10.0))
    assert events == [("all", COMPLETE, "", 9), ("p", COMPLETE, "", 5)]
    cache = host.call("cache", key)
    assert same_bytes(cache[:, :, [7, 8]], source[:, :, [2, 3]])
    assert not cache[:, :, [b for b in range(32) if b not in (7, 8)]].any()
    stats = sender.stats()
    assert stats.skipped_blocks == 5 and stats.units == 4
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
    # default the writer verifies its own copy: test_shm_sender_verifies_its_copy).
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
    if backend != "shm":
        assert not cache[:, :, [1, 2]].any()
    raw.close()
    sender.close()
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
        for name in (f"{SHM_PREFIX}-{key}", f"{SHM_PREFIX}-{key}-own"):
            if os.path.exists(f"/dev/shm/{name}"):  # the dead receiver could not unlink them
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
        cache = kt.allocate_cache(layout, num_blocks, shared_memory_name=f"{SHM_PREFIX}-race{next(_keys)}")
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


def test_shm_sender_verifies_its_copy(hosts, monkeypatch):
    """verify="sender" (the default): the writer crc32cs each chunk before and after its memmove;
    a copy that does not read back fails the transfer, and the receiver reports it."""
    import kvtransfer.shm_backend as shm

    host = hosts("shm")
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "flipped", [3, 4])
    real = shm.ctypes.memmove

    def bad_memmove(dst, src, n):
        real(dst, src, n)
        shm.ctypes.memset(dst + n // 2, 0x5A, 1)  # one byte lands wrong
    monkeypatch.setattr(shm.ctypes, "memmove", bad_memmove)
    sender = connected_sender("shm", endpoint, layout)
    send_all(sender, "flipped", source_cache(layout, 2, seed=8), [0, 1], first_token=1)
    status = wait_all(sender, ["flipped"])["flipped"]
    assert status.failed and "does not read back" in status.reason
    events = by_transfer(host.call("wait", key, 2, 10.0))
    assert [e[0] for e in events["flipped"]] == [FAILED, RELEASED]
    sender.close()
    host.call("close", key)
