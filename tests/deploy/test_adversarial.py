"""The internal plane of a cluster started the default way (`tandem serve`, no secret given, the
dist KV backend) against a caller on the same host who has no part in it, every attack in one
cluster's life: a fake worker with the model's public fingerprint, a claim on a live worker's
id (made with the cluster secret, so only the id binding stands in its way), a captured proof
replayed as it was and with another body, a direct Generate on the decode worker, the
launchers' `/internal/workers` through a local reverse proxy, and garbage and oversized frames
on every port the workers listen on (the dist backend's TCPStore among them). Each is refused,
each refusal shows on `/metrics` under its method and reason, no worker dies or registers
again, and the cluster still answers correctly with every KV block back in its pool."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.cluster_auth import PROOF_HEADER, REGISTER_METHOD, ClusterAuth, request_bytes
from common.internal_http import get_internal
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_hf_model
from tests.deploy.test_cluster_lifetime import ROOT, START_S
from tests.deploy.test_serve_secret import _environ, _processes, _stop
from tests.helpers.deploy_helpers import LineReader
from tests.helpers.proc_children import child_pids

STATUS = "/tandem.worker.DecodeWorker/Status"
GENERATE = "/tandem.worker.DecodeWorker/Generate"
EMBED = "/tandem.worker.DecodeWorker/Embed"
PROMPT = {"role": "user", "content": "the of and to in is"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(serve process, its coordinator URL, the registry address, the cluster secret, pids)."""
    tmp = tmp_path_factory.mktemp("adversarial")
    tiny = make_tiny_hf_model(tmp / "tiny")
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_SECRET"}
    env.update(PYTHONPATH=str(ROOT), TANDEM_HOME=str(tmp / "home"))
    port = free_port()
    argv = [sys.executable, "-m", "cli.main", "serve", "--model", str(tiny), "--port", str(port),
            "--grpc-port", "0", "--kv-backend", "dist", "--num-blocks", "16",
            "--decode-quant", "fp32", "--prefill-quant", "fp32", "--log-dir", str(tmp / "logs")]
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = LineReader(launcher)
    try:
        output.wait_for("is serving", launcher, time.monotonic() + START_S)
        output.wait_for("--coordinator", launcher, time.monotonic() + 10)
        registry = re.search(r"--coordinator (\S+)", "\n".join(output.seen)).group(1)
        pids = _workers_by_pid(launcher)
        secret = _environ(pids["decode"])["TANDEM_CLUSTER_SECRET"]
        yield launcher, f"http://127.0.0.1:{port}", registry, secret, pids
    finally:
        _stop(launcher)


def _workers_by_pid(launcher: subprocess.Popen) -> dict[str, int]:
    found = _processes(launcher)  # coordinator, and one of the workers as "worker"
    for pid in child_pids(launcher.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for role in ("prefill", "decode"):
            if f"{role}_node".encode() in cmdline:
                found[role] = pid
    return found


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on: what a port scan of its host finds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def _refused(text: str, process: str, method: str, reason: str) -> float:
    pattern = (r'^tandem_grpc_refused_calls_total\{method="' + re.escape(method) + r'",process="'
               + re.escape(process) + r'",reason="' + reason + r'"\} (\S+)$')
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def _chat(url: str) -> str:
    body = json.dumps({"model": "tiny", "messages": [PROMPT], "stream": False,
                       "options": {"temperature": 0, "num_predict": 12}}).encode()
    request = urllib.request.Request(f"{url}/api/chat", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())["message"]["content"]


def _proxy(target_port: int) -> tuple[int, threading.Event]:
    """A reverse proxy on this host in front of the coordinator's HTTP port (raw TCP relay, as
    nginx's stream module or a sidecar would be): its connections reach the coordinator from
    127.0.0.1."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", target_port), timeout=10)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], stop


def test_every_attack_on_the_internal_plane_is_refused_counted_and_harmless(cluster):
    launcher, url, registry, secret, pids = cluster
    expected = _chat(url)  # the unattacked answer
    workers = {w["worker_id"]: w for w in get_internal(url, secret)["workers"]}
    decode, prefill = workers["decode-0"], workers["prefill-0"]
    before = _metrics(url)
    insider = ClusterAuth.from_sources(None, {"TANDEM_CLUSTER_SECRET": secret})

    with grpc.insecure_channel(registry) as channel:
        stub = pb_grpc.RegistryStub(channel)
        # 1. A fake worker: the model's fingerprint and KV layout are public (/api/show and
        # any worker's handshake give them), the secret is not.
        fake = pb.WorkerInfo(worker_id="rogue", role="decode", address=f"127.0.0.1:{free_port()}",
                             kv_endpoint=f"tcp://127.0.0.1:{free_port()}", kv_backend="dist",
                             model_fingerprint=decode["model_fingerprint"],
                             kv_layout_fingerprint=decode["kv_layout_fingerprint"])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(fake, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # 2. decode-0's id claimed from another address, with a valid proof of the secret:
        # the live holder answers its Status probe, so the claim is refused.
        claim = pb.WorkerInfo(worker_id="decode-0", role="decode", address=fake.address,
                              kv_endpoint=fake.kv_endpoint, kv_backend="dist",
                              model_fingerprint=decode["model_fingerprint"],
                              kv_layout_fingerprint=decode["kv_layout_fingerprint"])
        proof = insider.proof(REGISTER_METHOD, body=request_bytes(claim))
        reply = stub.Register(claim, timeout=30, metadata=((PROOF_HEADER, proof),))
        assert not reply.accepted and "in use by the live worker" in reply.reason

    with grpc.insecure_channel(decode["address"]) as channel:
        worker = pb_grpc.DecodeWorkerStub(channel)
        # 3. A proof captured on the wire (no TLS here): it opened one Status call, and opens
        # neither the same call again nor the same method with another request.
        status = pb.StatusRequest()
        captured = insider.proof(STATUS, body=request_bytes(status))
        worker.Status(status, timeout=10, metadata=((PROOF_HEADER, captured),))
        # StatusRequest has no fields: the altered body carries an unknown one, which the
        # server keeps and the proof's hash covers.
        raw_status = channel.unary_unary(STATUS, request_serializer=lambda b: b,
                                         response_deserializer=pb.WorkerStatus.FromString)
        for body, why in ((status.SerializeToString(), "replayed"), (b"\x08\x01", "altered")):
            with pytest.raises(grpc.RpcError) as refused:
                raw_status(body, timeout=10, metadata=((PROOF_HEADER, captured),))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
        # 4. Generate on the decode worker directly, past the coordinator and its API key.
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(worker.Generate(pb.GenerateRequest(request_id="forged"), timeout=10)))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # 4b. An insider's Embed with a pooling number the protocol does not have (proto3
        # keeps an unknown enum value as its number): refused as a bad argument, nothing queued.
        embed = pb.EmbedRequest(request_id="forged", inputs=[pb.TokenIds(token_ids=[1, 2])],
                                pooling=7)
        with pytest.raises(grpc.RpcError) as refused:
            worker.Embed(embed, timeout=30, metadata=(
                (PROOF_HEADER, insider.proof(EMBED, body=request_bytes(embed))),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown pooling 7" in refused.value.details()

    # 5. The launchers' worker list through a reverse proxy on the coordinator's own host.
    proxy_port, stop_proxy = _proxy(int(url.rsplit(":", 1)[1]))
    try:
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(f"http://127.0.0.1:{proxy_port}/internal/workers", timeout=10)
        assert denied.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{proxy_port}/internal/workers",
                headers={"X-Forwarded-For": "127.0.0.1"}), timeout=10)
        assert denied.value.code == 403
    finally:
        stop_proxy.set()

    # 6. Noise, a frame claiming 2**62 bytes and a 2**40-byte value on every port each worker
    # listens on: the dist backend's TCPStore (gloo aborts a process on an oversized payload),
    # the zmq control channel and the gRPC server.
    scanned = {role: _listening_ports(pids[role]) for role in ("prefill", "decode")}
    assert len(scanned["decode"]) >= 3, scanned  # gRPC, KV control, TCPStore at least
    for ports in scanned.values():
        for port in ports:
            for frame in (b"\xde\xad" * 5000, b"\x01" + struct.pack("<Q", 2**62),
                          b"\x01" + struct.pack("<Q", 3) + b"key" + struct.pack("<Q", 2**40)
                          + b"x" * 4096):
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                        s.sendall(frame)
                        time.sleep(0.05)
                except OSError:
                    pass  # the far side closed on us: refused, which is the point

    # Nothing died or had to register again; the cluster answers as before, every block free.
    for role in ("prefill", "decode", "coordinator"):
        assert Path(f"/proc/{pids[role]}").exists(), f"the {role} died"
    assert launcher.poll() is None
    assert _chat(url) == expected
    deadline = time.monotonic() + 30
    while True:  # each worker's refusals reach /metrics with its next heartbeat
        after = _metrics(url)
        counts = {
            "fake worker": _refused(after, "coordinator", REGISTER_METHOD, "no_proof"),
            "claimed id": _refused(after, "coordinator", REGISTER_METHOD, "id_in_use"),
            "replayed": _refused(after, "decode-0", STATUS, "replayed"),
            "other body": _refused(after, "decode-0", STATUS, "other_request"),
            "direct Generate": _refused(after, "decode-0", GENERATE, "no_proof"),
            "proxied list": _refused(after, "coordinator", "GET /internal/workers", "no_proof")
                            + _refused(after, "coordinator", "GET /internal/workers", "off_host"),
        }
        grown = {k: v - _baseline(before, k) for k, v in counts.items()}
        if all(grown.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert grown == {"fake worker": 1, "claimed id": 1, "replayed": 1, "other body": 1,
                     "direct Generate": 1, "proxied list": 2}, grown
    live = {w["worker_id"]: w for w in get_internal(url, secret)["workers"]}
    assert set(live) == {"prefill-0", "decode-0"}
    assert live["decode-0"]["address"] == decode["address"]
    assert all(w["alive"] and w["num_free_blocks"] == w["num_blocks"] for w in live.values())
    assert live["prefill-0"]["address"] == prefill["address"]


_BASE_KEYS = {
    "fake worker": ("coordinator", REGISTER_METHOD, "no_proof"),
    "claimed id": ("coordinator", REGISTER_METHOD, "id_in_use"),
    "replayed": ("decode-0", STATUS, "replayed"),
    "other body": ("decode-0", STATUS, "other_request"),
    "direct Generate": ("decode-0", GENERATE, "no_proof"),
}


def _baseline(text: str, key: str) -> float:
    if key == "proxied list":
        return (_refused(text, "coordinator", "GET /internal/workers", "no_proof")
                + _refused(text, "coordinator", "GET /internal/workers", "off_host"))
    return _refused(text, *_BASE_KEYS[key])
