"""The local launcher: process plan, start-up with a real coordinator process and fake worker
processes, failure reporting, and stopping every child."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from deploy.local import LaunchError, LocalCluster, ProcessSpec, Topology, plan
from tests.coordinator_fakes import free_port, make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def ports():
    n = iter(range(20000, 20100))
    return lambda: next(n)


def test_plan_disaggregated(tmp_path):
    t = Topology(model="smollm2", model_path=tmp_path / "m.gguf", log_dir=tmp_path / "logs",
                 prefill=2, decode=1, kv_backend="shm", chunk_size=256, prefill_threshold=32)
    specs, ready = plan(t, ports())
    assert [s.name for s in specs] == ["coordinator", "prefill-0", "prefill-1", "decode-0"]
    coord = specs[0].argv
    assert coord[1:3] == ["-m", "coordinator"]
    assert coord[coord.index("--registry-port") + 1] == "20000"
    assert coord[coord.index("--prefill-threshold") + 1] == "32"
    assert coord[coord.index("--model") + 1] == "smollm2"
    worker_ports = set()
    for spec in specs[1:]:
        argv = spec.argv
        assert argv[2] == ("prefill_node" if spec.name.startswith("prefill") else "decode_node")
        assert argv[argv.index("--coordinator") + 1] == "127.0.0.1:20000"
        assert argv[argv.index("--kv-backend") + 1] == "shm"
        assert argv[argv.index("--worker-id") + 1] == spec.name
        assert argv[argv.index("--model") + 1] == str(tmp_path / "m.gguf")
        assert argv[argv.index("--max-batched-tokens") + 1] == "256"
        worker_ports.add(argv[argv.index("--port") + 1])
        assert spec.log_path == tmp_path / "logs" / f"{spec.name}.log"
    assert len(worker_ports) == 3
    assert specs[3].argv[-2:] == ["--role", "decode"]
    assert ready.url == "http://127.0.0.1:11434"
    assert ready.expected == {"prefill": 2, "decode": 1}


def test_plan_colocated_and_validation(tmp_path):
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True)
    specs, ready = plan(t, ports())
    assert [s.name for s in specs] == ["coordinator", "colocated-0"]
    assert specs[1].argv[-2:] == ["--role", "colocated"]
    assert ready.expected == {"colocated": 1}
    with pytest.raises(ValueError, match="kv_backend"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, kv_backend="carrier-pigeon")
    with pytest.raises(ValueError, match="decode worker"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, decode=0)


def test_cluster_starts_until_workers_are_live_and_stops_every_child(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    t = Topology(model=str(model_dir), model_path=model_dir, log_dir=tmp_path / "logs",
                 port=free_port(), prefill=1, decode=1)
    specs, ready = plan(t)
    # The real coordinator process; fake worker processes in place of the lead's workers.
    specs = [specs[0]] + [
        ProcessSpec(s.name, [sys.executable, "-m", "tests.fake_worker_process", *s.argv[3:]],
                    s.log_path) for s in specs[1:]]
    cluster = LocalCluster(specs, ready, start_timeout_s=60, grace_s=5,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    with cluster:
        cluster.start()
        with urllib.request.urlopen(f"{ready.url}/internal/workers", timeout=5) as r:
            report = json.loads(r.read())
        processes = [c.process for c in cluster.children]
    assert report["live"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert sorted(w["worker_id"] for w in report["workers"]) == ["decode-0", "prefill-0"]
    assert all(p.poll() is not None for p in processes)
    assert "registered" in (tmp_path / "logs" / "coordinator.log").read_text()


def test_child_dying_during_start_up_stops_the_rest_and_names_it(tmp_path):
    sleeper = ProcessSpec("coordinator", [sys.executable, "-c", "import time; time.sleep(60)"],
                          tmp_path / "coordinator.log")
    crasher = ProcessSpec("decode-0", [sys.executable, "-c",
                                       "import sys; print('cannot load model: boom'); sys.exit(3)"],
                          tmp_path / "decode-0.log")
    from deploy.local import Readiness

    cluster = LocalCluster([sleeper, crasher], Readiness(f"http://127.0.0.1:{free_port()}",
                                                         {"decode": 1}),
                           start_timeout_s=30, grace_s=5)
    with pytest.raises(LaunchError) as info:
        cluster.start()
    message = str(info.value)
    assert "decode-0 exited with code 3 during start-up" in message
    assert "cannot load model: boom" in message
    assert [c.process.poll() for c in cluster.children] == [-15, 3]  # the sleeper was stopped


def test_tandem_serve_reports_bad_topologies_without_traceback(tmp_path):
    import subprocess

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TANDEM_HOME": str(tmp_path / "h")}

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "deploy.cli", "serve", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    zero = serve("--model", str(model_dir), "--decode", "0")
    assert zero.returncode == 1 and "Traceback" not in zero.stderr
    assert "at least one decode worker" in zero.stderr
    missing = serve("--model", str(tmp_path / "nothing-here"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "no model named" in missing.stderr
    backend = serve("--kv-backend", "carrier-pigeon")
    assert backend.returncode == 2 and "invalid choice" in backend.stderr
