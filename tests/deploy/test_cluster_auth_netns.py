"""A cluster with the authenticated internal plane across network namespaces (the hosts of
tests/deploy/test_deploy_netns.py): `tandem launch` with a [security] table (cluster secret file,
mutual TLS from files) serves a request whose KV crosses hosts over CURVE, while a client
without a certificate of the cluster's CA cannot reach the Registry."""

from __future__ import annotations

import json
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

# Run inside a host: Register with the Registry over plain TCP, over TLS without a client
# certificate, and with the cluster's certificate but no secret; prints each outcome.
PROBE = r"""
import json, sys, grpc
from common.rpc import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
target, ca, cert, key = sys.argv[1:5]
read = lambda p: open(p, "rb").read()
channels = {
    "plain": grpc.insecure_channel(target),
    "no cert": grpc.secure_channel(target, grpc.ssl_channel_credentials(read(ca))),
    "cert, no secret": grpc.secure_channel(target, grpc.ssl_channel_credentials(
        read(ca), read(key), read(cert))),
}
out = {}
for name, channel in channels.items():
    try:
        pb_grpc.RegistryStub(channel).Register(pb.WorkerInfo(worker_id="rogue"), timeout=10)
        out[name] = "accepted"
    except grpc.RpcError as exc:
        out[name] = exc.code().name
print(json.dumps(out))
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
        probe = json.loads(in_host(lan, 4, [sys.executable, "-c", PROBE,
                                            f"{lan.address(1)}:50050", str(node.ca),
                                            str(node.cert), str(node.key)]))
        assert probe == {"plain": "UNAVAILABLE", "no cert": "UNAVAILABLE",
                         "cert, no secret": "UNAUTHENTICATED"}
        assert launcher.poll() is None
    finally:
        down = subprocess.run([*lan.exec_prefix(1), sys.executable, "-m", "cli.main", "launch",
                               "--down", str(topology)], capture_output=True, text=True,
                              timeout=60)
        code = launcher.wait(30)
    assert down.returncode == 0, down.stderr
    assert code == 0
    assert lan.pids() == []
