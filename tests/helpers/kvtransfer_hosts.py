"""Receiver hosts and raw clients for the kvtransfer tests (tests/test_kvtransfer_*.py).

zmq, shm, grpc and dist receivers live in a spawned host process per backend, driven through
a pipe (open a receiver, expect, cancel, wait for events, read the cache back); the fake's lives in
the test process behind the same interface. The test process is the sender. Units that no
honest sender would send (bad checksum, foreign blocks) come from `RawClient`, which speaks
each backend's wire protocol by hand.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import zmq

import kvtransfer as kt
from kvtransfer.message import (
    Ack, Grant, GrantRequest, HandshakeRequest, KVHeader,
)

BACKENDS = ["fake", "zmq", "shm", "grpc", "dist"]
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
        if cmd == "write":  # what an shm writer does: blocks written in place, by hand
            _, layers, blocks, payload = args
            for i, layer in enumerate(layers):
                cache.tensor[layer][:, blocks] = payload[i]
            return None
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


KEYS = iter(range(10**6))  # unique receiver keys and sender ids across the kvtransfer tests


def open_receiver(host, dtype: str = "float32", num_blocks: int = 32, ipc: bool = False, **options):
    key = f"{'ipc' if ipc else 'k'}{next(KEYS)}"
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
        self.backend, self.layout, self.sender_id = backend, layout, f"raw-{next(KEYS)}"
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
            if backend == "dist":  # the payloads' process group, joined as an honest sender would
                self.group = join_dist_pair(self, endpoint)

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

    def unit(self, header: KVHeader, data: bytes | list[bytes] | None) -> Ack:
        """A data unit; data None = shm's notification that the blocks are written in place; a
        list = the payload cut into frames (zmq sends each as a frame of its own)."""
        from dataclasses import replace

        header = replace(header, sender_id=self.sender_id)
        if isinstance(data, list) and self.backend not in ("zmq", "grpc"):
            data = b"".join(data)
        if self.backend == "fake":
            return self.table.ingest(header, data)
        if self.backend == "grpc":
            from kvtransfer.pb import kvtransfer_pb2 as pb

            parts = data if isinstance(data, list) else [data or b""]  # a list: one chunk each
            chunks = [pb.PushChunk(header=header.to_pb(), data=parts[0])]
            chunks += [pb.PushChunk(data=part) for part in parts[1:]]
            return Ack.from_pb(self.stub.Push(iter(chunks), timeout=10))
        if self.backend == "dist":  # the tensor over the group, then its header
            work = self.group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], 0, 0)
            self.sock.send_multipart([b"T", header.encode()])
            ack = Ack.decode(self.recv(b"A"))
            work.wait()
            return ack
        if data is None:
            self.sock.send_multipart([b"N", header.encode()])
        else:
            self.sock.send_multipart([b"D", header.encode(), *(data if isinstance(data, list) else [data])])
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
            self.group = None  # dist: drops the pair's connections
            self.sock.close()
            self.ctx.term()


def join_dist_pair(raw: RawClient, endpoint: str):
    """A raw client's process group with a dist receiver (rank 1, as DistSender joins it)."""
    import json

    from kvtransfer import dist_group
    from kvtransfer.fence import own_identity

    pid, start = own_identity()
    request = {"sender_id": raw.sender_id, "pid": pid, "start": start}
    raw.sock.send_multipart([b"S", json.dumps(request).encode()])
    reply = json.loads(raw.recv(b"s"))
    assert reply["ok"], reply
    host = dist_group.endpoint_host(endpoint)
    store = dist_group.join_store(host, reply["port"], 10.0)
    return dist_group.pair_group(store, reply["key"], dist_group.SENDER_RANK, reply["backend"], host, 10.0)
