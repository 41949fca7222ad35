"""A default `tandem serve` (no secret given) is an authenticated cluster: it makes a secret and
hands it to every process it starts through the environment, never the command line, and its
Registry refuses a worker without it (and counts the refusal). Real processes, tiny random
model; the operator's own $TANDEM_CLUSTER_SECRET is kept when given."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from common.internal_http import get_internal
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_hf_model
from tests.deploy.test_cluster_lifetime import ROOT, START_S, _children
from tests.helpers.deploy_helpers import LineReader
from worker.runtime import worker_env

OPERATORS = "an-operator-secret-of-32-bytes!!"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("model") / "tiny")


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _serve(tiny: Path, tmp_path: Path, secret: str | None):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_SECRET"}
    env.update(PYTHONPATH=str(ROOT), TANDEM_HOME=str(tmp_path / "home"))
    if secret:
        env["TANDEM_CLUSTER_SECRET"] = secret
    port = free_port()
    argv = [sys.executable, "-m", "cli.main", "serve", "--model", str(tiny), "--port", str(port),
            "--grpc-port", "0", "--colocated", "--num-blocks", "16",
            "--log-dir", str(tmp_path / "logs")]
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return process, LineReader(process), port


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def _processes(launcher: subprocess.Popen) -> dict[str, int]:
    """coordinator / worker -> pid, among the launcher's children."""
    found = {}
    for pid in _children(launcher.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"coordinator" in cmdline:
            found["coordinator"] = pid
        elif b"decode_node" in cmdline:
            found["worker"] = pid
    return found


def test_default_serve_hands_its_processes_a_secret_in_the_environment_and_refuses_a_rogue(
        tiny, tmp_path):
    launcher, output, port = _serve(tiny, tmp_path, None)
    try:
        output.wait_for("is serving", launcher, time.monotonic() + START_S)
        output.wait_for("--coordinator", launcher, time.monotonic() + 10)  # the worker's argv
        pids = _processes(launcher)
        assert set(pids) == {"coordinator", "worker"}
        secrets = {name: _environ(pid).get("TANDEM_CLUSTER_SECRET") for name, pid in pids.items()}
        secret = secrets["worker"]
        assert secret and len(secret) == 64 and secrets["coordinator"] == secret
        for pid in (launcher.pid, *pids.values()):
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret not in "\n".join(output.seen)

        registry = re.search(r"--coordinator (\S+)", "\n".join(output.seen)).group(1)
        env = {k: v for k, v in worker_env().items() if k != "TANDEM_CLUSTER_SECRET"}
        rogue = subprocess.run(
            [sys.executable, "-m", "decode_node", "--model", str(tiny), "--port", str(free_port()),
             "--coordinator", registry, "--worker-id", "rogue", "--num-blocks", "16"],
            cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
            timeout=180)
        assert rogue.returncode == 1, rogue.stderr[-2000:]
        assert "registration refused" in rogue.stderr and "no cluster proof" in rogue.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert ('tandem_grpc_refused_calls_total{method="/tandem.worker.Registry/Register",'
                'process="coordinator",reason="no_proof"} 1') in metrics
        log = (tmp_path / "logs" / "coordinator.log").read_text()
        assert "refused /tandem.worker.Registry/Register" in log
        # The launchers' worker list needs the cluster proof, even from this host.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/internal/workers", timeout=10)
        assert refused.value.code == 403
        workers = get_internal(f"http://127.0.0.1:{port}", secret)["workers"]
        assert workers and "rogue" not in {w["worker_id"] for w in workers}
    finally:
        _stop(launcher)


def test_serve_keeps_the_operators_secret(tiny, tmp_path):
    launcher, output, _ = _serve(tiny, tmp_path, OPERATORS)
    try:
        output.wait_for("is serving", launcher, time.monotonic() + START_S)
        pids = _processes(launcher)
        assert {_environ(pid).get("TANDEM_CLUSTER_SECRET") for pid in pids.values()} == {OPERATORS}
    finally:
        _stop(launcher)
