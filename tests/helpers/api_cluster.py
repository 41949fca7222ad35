"""One real tandem cluster (coordinator + prefill + decode processes) on a tiny random model,
for the client-API tests. Each test module that imports `api_cluster` starts its own."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass

import pytest

from deploy.process_plan import free_port
from tests.helpers.cluster import Cluster, running_cluster
from reliability.model_factory import make_tiny_hf_model

MODEL = "tiny"
WORKER_ARGS = ("--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32")
MAX_BODY = 64 * 1024
GREEDY = {"temperature": 0, "num_predict": 12}


@dataclass
class ApiCluster:
    cluster: Cluster
    grpc_target: str

    @property
    def url(self) -> str:
        return self.cluster.url

    def cancelled_requests(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r'^tandem_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
        assert m, "no cancelled-requests series in /metrics"
        return float(m.group(1))

    def wait_cancelled(self, count: float, timeout_s: float = 30.0) -> float:
        """Polls until the coordinator has recorded `count` cancelled requests (or the deadline
        passes); returns the last reading, which the caller asserts on."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.cancelled_requests()) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return seen

    def coordinator_log(self) -> str:
        return (self.cluster.log_dir / "coordinator.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    grpc_port = free_port()
    with running_cluster(model_dir, root / "logs", model=MODEL, worker_args=WORKER_ARGS,
                         coordinator_args=("--grpc-port", str(grpc_port),
                                           "--max-body-bytes", str(MAX_BODY))) as cluster:
        yield ApiCluster(cluster, f"127.0.0.1:{grpc_port}")
