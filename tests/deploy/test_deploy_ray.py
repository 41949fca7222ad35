"""deploy.ray_launcher on a real local Ray cluster: a head node and a second node, each its own
raylet process on this machine (ray.cluster_utils.Cluster), both on 127.0.0.1. The prefill
worker must land on the node with the "prefill" resource and the decode worker on the one
with "decode"; a chat request is then served through them."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

# Every Ray address on loopback: without this Ray swaps 127.0.0.1 for the machine's network
# address, which this test must not use. Read when ray is imported, so set before that.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import ray  # noqa: E402  (the ray and test extras)
from ray.cluster_utils import Cluster  # noqa: E402

from deploy.ray_launcher import RayLauncher, RayTopology  # noqa: E402
from reliability.model_factory import make_tiny_gguf  # noqa: E402

SECRET = "ray-test-cluster-secret-0123456789"
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}


@pytest.fixture
def two_node_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={
        **NODE, "resources": {"prefill": 1, "coordinator": 1}, "include_dashboard": False})
    decode_node = cluster.add_node(**NODE, resources={"decode": 1})
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster, decode_node
    finally:
        ray.shutdown()
        cluster.shutdown()


def raylet_pids(node) -> list[int]:
    return [p.process.pid for p in node.all_processes["raylet"]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_roles_are_pinned_by_resource_and_serve_a_request(two_node_cluster, tmp_path):
    cluster, decode_node = two_node_cluster
    head = cluster.head_node
    assert raylet_pids(head) != raylet_pids(decode_node)  # two raylets really run
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2

    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    make_tiny_gguf(home / "models" / "tiny.gguf")
    topology = RayTopology(
        model="tiny", http_port=0, prefill_threshold=0, log_dir=str(tmp_path / "logs"),
        coordinator_resources={"coordinator": 1},
        worker_args=("--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32"),
        env={"TANDEM_HOME": str(home), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"},
        cluster_secret=SECRET)  # every process gets it in its environment, none on argv
    assert SECRET not in repr(topology)
    assert topology.process_env()["TANDEM_CLUSTER_SECRET"] == SECRET
    with RayLauncher(topology, start_timeout_s=120, grace_s=10) as launcher:
        launcher.start()
        placed = {r.name: r for r in launcher.roles}
        pids = [r.pid for r in launcher.roles]
        assert placed["prefill-0"].node_id == head.node_id
        assert placed["decode-0"].node_id == decode_node.node_id
        assert placed["coordinator"].node_id == head.node_id

        body = {"model": "tiny", "stream": False, "options": {"num_predict": 8, "temperature": 0},
                "messages": [{"role": "user", "content": "Tell me a story about a river. " * 3}]}
        req = urllib.request.Request(launcher.url + "/api/chat", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["done"] and reply["eval_count"] >= 1
        assert reply["tandem"]["prefill_worker"] == "prefill-0"
        assert reply["tandem"]["decode_worker"] == "decode-0"
    assert launcher.roles == []
    assert [pid for pid in pids if alive(pid)] == []
