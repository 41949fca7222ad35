"""Workers of another model are refused when they register, not at their first request: a
decode worker whose model file differs from the coordinator's (a second tiny model) exits
with the refusal, is never listed as a worker, and every request goes to the matching one."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.cluster import running_cluster
from tests.helpers.coordinator_fakes import free_port
from reliability.model_factory import make_tiny_gguf

SMALL_WORKER = ("--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32")


def test_worker_with_another_model_is_refused_at_registration_and_gets_no_traffic(tmp_path):
    for folder in ("served", "other"):
        (tmp_path / folder).mkdir()
    served = make_tiny_gguf(tmp_path / "served" / "tiny.gguf", seed=0).path
    other = make_tiny_gguf(tmp_path / "other" / "tiny.gguf", seed=1).path
    with running_cluster(served, tmp_path / "logs", prefill_threshold=0,
                         worker_args=SMALL_WORKER) as cluster:
        coordinator_argv = cluster.handle.specs[0].argv
        registry = coordinator_argv[coordinator_argv.index("--registry-port") + 1]
        log = tmp_path / "logs" / "decode-other.log"
        with open(log, "wb") as out:
            intruder = subprocess.Popen(
                [sys.executable, "-m", "decode_node", "--model", str(other), "--port",
                 str(free_port()), "--coordinator", f"127.0.0.1:{registry}",
                 "--worker-id", "decode-other", *SMALL_WORKER],
                stdout=out, stderr=subprocess.STDOUT)
            try:
                code = intruder.wait(90)
            finally:
                if intruder.poll() is None:
                    intruder.kill()
                    intruder.wait(10)
        text = log.read_text()
        assert code != 0, text
        assert "registration refused: model fingerprint" in text
        assert "does not match the coordinator's" in text
        assert {w["worker_id"] for w in cluster.workers()} == {"prefill-0", "decode-0"}
        coordinator_log = (tmp_path / "logs" / "coordinator.log").read_text()
        assert "refused worker 'decode-other'" in coordinator_log

        for _ in range(3):
            reply = cluster.chat([{"role": "user", "content": "Tell me about rivers. " * 4}],
                                 options={"num_predict": 4, "temperature": 0})
            assert reply["tandem"]["decode_worker"] == "decode-0"
            assert reply["tandem"]["prefill_worker"] == "prefill-0"
