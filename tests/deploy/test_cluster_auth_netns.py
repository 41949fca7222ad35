"""A cluster with the authenticated internal plane across network namespaces (the hosts of
tests/deploy/test_deploy_netns.py): `tandem launch` with a [security] table (cluster secret file,
mutual TLS from files) serves a request whose KV crosses hosts over CURVE, while an attacker on
a fourth host cannot join it, whatever it holds: without a certificate of the cluster's CA it
reaches neither the Registry nor a worker; with a stolen certificate but no secret every call is
refused; with the secret too, it can neither take a live worker's id nor replay a captured proof.
Its garbage on the worker's ports kills nothing, `/internal/workers` refuses it without a proof,
and each refusal shows on the coordinator's /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

from tests.helpers.deploy_helpers import LineReader
from reliability.model_factory import make_tiny_gguf
from tests.deploy.test_deploy_netns import (  # noqa: F401 (lan: a pytest fixture, used by name)
    DEADLINE_S, HOSTS, chats, in_host, lan, workers, write_topology,
)
from tests.helpers.tls_certs import issue, make_ca

# Run inside a host: Register with the Registry, and Generate on a worker, over plain TCP, over
# TLS without a client certificate, and with the cluster's certificate but no secret.
PROBE = r"""
import json, sys, grpc
from common.rpc import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
registry, worker, ca, cert, key = sys.argv[1:6]
read = lambda p: open(p, "rb").read()
credentials = {
    "plain": None,
    "no cert": lambda: grpc.ssl_channel_credentials(read(ca)),
    "cert, no secret": lambda: grpc.ssl_channel_credentials(read(ca), read(key), read(cert)),
}
def channel(target, name):
    make = credentials[name]
    return grpc.insecure_channel(target) if make is None else grpc.secure_channel(target, make())
out = {}
for name in credentials:
    try:
        pb_grpc.RegistryStub(channel(registry, name)).Register(pb.WorkerInfo(worker_id="rogue"),
                                                               timeout=10)
        out[name] = "accepted"
    except grpc.RpcError as exc:
        out[name] = exc.code().name
    try:
        next(iter(pb_grpc.DecodeWorkerStub(channel(worker, name)).Generate(
            pb.GenerateRequest(request_id="forged"), timeout=10)))
        out["Generate, " + name] = "accepted"
    except grpc.RpcError as exc:
        out["Generate, " + name] = exc.code().name
print(json.dumps(out))
"""

# Run inside a host holding the cluster's certificate AND its secret (a compromised insider):
# claim the live decode-0's id from another address, replay a proof captured for one Status
# call as it was and with an altered body, then send garbage to every port of the worker.
INSIDER = r"""
import json, socket, struct, sys, time, grpc
from common.cluster_auth import PROOF_HEADER, REGISTER_METHOD, ClusterAuth, request_bytes
from common.rpc import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
registry, worker, ca, cert, key, secret_file, fingerprint, layout, ports = sys.argv[1:10]
read = lambda p: open(p, "rb").read()
creds = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
auth = ClusterAuth.from_sources(secret_file)
out = {}
claim = pb.WorkerInfo(worker_id="decode-0", role="decode", address="10.77.0.4:50071",
                      kv_endpoint="tcp://10.77.0.4:50081", kv_backend="zmq",
                      model_fingerprint=fingerprint, kv_layout_fingerprint=layout)
proof = auth.proof(REGISTER_METHOD, body=request_bytes(claim))
reply = pb_grpc.RegistryStub(grpc.secure_channel(registry, creds)).Register(
    claim, timeout=30, metadata=((PROOF_HEADER, proof),))
out["claim"] = "accepted" if reply.accepted else reply.reason
status = "/tandem.worker.DecodeWorker/Status"
raw = grpc.secure_channel(worker, creds).unary_unary(
    status, request_serializer=lambda b: b, response_deserializer=pb.WorkerStatus.FromString)
captured = auth.proof(status, body=b"")
raw(b"", timeout=10, metadata=((PROOF_HEADER, captured),))
for name, body in (("replayed", b""), ("altered", b"\x08\x01")):
    try:
        raw(body, timeout=10, metadata=((PROOF_HEADER, captured),))
        out[name] = "accepted"
    except grpc.RpcError as exc:
        out[name] = exc.code().name
host = worker.rsplit(":", 1)[0]
for port in json.loads(ports):
    for frame in (b"\xde\xad" * 5000, b"\x01" + struct.pack("<Q", 2**62)):
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(frame)
                time.sleep(0.05)
        except OSError:
            pass
print(json.dumps(out))
"""

# Run inside a host: the launchers' worker list without the cluster proof; prints the status.
UNPROVEN_LIST = r"""
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/internal/workers", timeout=10)
    print(200)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""

# Run inside a host: the coordinator's /metrics text.
METRICS = r"""
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=10).read().decode())
"""


def test_a_mutual_tls_cluster_serves_across_namespaces(lan, tmp_path):
    source = make_tiny_gguf(tmp_path / "tiny.gguf").path
    homes = {}
    for i in range(1, HOSTS + 1):
        homes[i] = tmp_path / f"home-h{i}"
        (homes[i] / "models").mkdir(parents=True)
        shutil.copy(source, homes[i] / "models" / "tiny.gguf")
    ca = make_ca(tmp_path / "pki")
    node = issue(tmp_path / "pki", ca, "node",
                 addresses=("127.0.0.1", *(lan.address(i) for i in range(1, HOSTS + 1))))
    (tmp_path / "secret").write_text("netns cluster secret 0123456789abcdef\n")
    topology = write_topology(tmp_path, lan, homes)
    with open(topology, "a") as f:
        f.write(f'\n[security]\ncluster_secret_file = "{tmp_path / "secret"}"\n'
                f'tls_cert = "{node.cert}"\ntls_key = "{node.key}"\ntls_ca = "{node.ca}"\n')
    url = f"http://{lan.address(1)}:11434"
    deadline = time.monotonic() + DEADLINE_S

    launcher = subprocess.Popen(
        [*lan.exec_prefix(1), sys.executable, "-m", "cli.main", "launch", str(topology)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = LineReader(launcher)
        out.wait_for("stop with Ctrl-C", launcher, deadline)
        # prefill on h2, decode on h3: the KV crosses hosts (CURVE), every call is mutual TLS.
        for reply in chats(lan, url, count=1, num_predict=8):
            assert reply["done"] and reply["eval_count"] >= 1
            assert reply["tandem"]["prefill_worker"] == "prefill-0"
            assert reply["tandem"]["decode_worker"] == "decode-0"
        assert {w["worker_id"] for w in workers(lan, url, tmp_path / "secret").values()
                if w["alive"]} == {
            "prefill-0", "decode-0"}
        live = workers(lan, url, tmp_path / "secret")
        decode = live["decode-0"]
        registry = f"{lan.address(1)}:50050"
        pki = [str(node.ca), str(node.cert), str(node.key)]
        probe = json.loads(in_host(lan, 4, [sys.executable, "-c", PROBE, registry,
                                            decode["address"], *pki]))
        assert probe == {"plain": "UNAVAILABLE", "no cert": "UNAVAILABLE",
                         "cert, no secret": "UNAUTHENTICATED",
                         "Generate, plain": "UNAVAILABLE", "Generate, no cert": "UNAVAILABLE",
                         "Generate, cert, no secret": "UNAUTHENTICATED"}, probe
        ports = [50071, 50081]  # the decode worker's gRPC and KV ports (write_topology)
        insider = json.loads(in_host(lan, 4, [
            sys.executable, "-c", INSIDER, registry, decode["address"], *pki,
            str(tmp_path / "secret"), decode["model_fingerprint"],
            decode["kv_layout_fingerprint"], json.dumps(ports)]))
        assert "in use by the live worker" in insider.pop("claim")
        assert insider == {"replayed": "UNAUTHENTICATED", "altered": "UNAUTHENTICATED"}, insider
        assert in_host(lan, 4, [sys.executable, "-c", UNPROVEN_LIST, url]).strip() == "403"
        # Nothing died or moved: the same decode worker, alive, answers the next chat.
        for reply in chats(lan, url, count=1, num_predict=8):
            assert reply["done"] and reply["tandem"]["decode_worker"] == "decode-0"
        after = workers(lan, url, tmp_path / "secret")["decode-0"]
        assert after["alive"] and after["address"] == decode["address"]
        refused = {}
        deadline_m = time.monotonic() + 30
        while time.monotonic() < deadline_m:  # a worker's counts come with its next heartbeat
            text = in_host(lan, 1, [sys.executable, "-c", METRICS, url])
            refused = {(m.group(2), m.group(1), m.group(3)): float(m.group(4)) for m in re.finditer(
                r'^tandem_grpc_refused_calls_total\{method="([^"]+)",process="([^"]+)",'
                r'reason="([^"]+)"\} (\S+)$', text, re.M)}
            if refused.get(("decode-0", "/tandem.worker.DecodeWorker/Status", "replayed")):
                break
            time.sleep(0.5)
        register = "/tandem.worker.Registry/Register"
        assert refused[("coordinator", register, "no_proof")] >= 1, refused
        assert refused[("coordinator", register, "id_in_use")] == 1, refused
        assert refused[("coordinator", "GET /internal/workers", "no_proof")] == 1, refused
        assert refused[("decode-0", "/tandem.worker.DecodeWorker/Generate", "no_proof")] == 1
        assert refused[("decode-0", "/tandem.worker.DecodeWorker/Status", "replayed")] == 1
        assert refused[("decode-0", "/tandem.worker.DecodeWorker/Status", "other_request")] == 1
        assert launcher.poll() is None
    finally:
        down = subprocess.run([*lan.exec_prefix(1), sys.executable, "-m", "cli.main", "launch",
                               "--down", str(topology)], capture_output=True, text=True,
                              timeout=60)
        code = launcher.wait(30)
    assert down.returncode == 0, down.stderr
    assert code == 0
    assert lan.pids() == []
