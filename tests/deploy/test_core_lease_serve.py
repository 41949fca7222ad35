"""`tandem serve` and its host's core lease (deploy/local.py, common/core_lease.py): the plan
gives every worker its slot where prefill and decode workers share the host, and none
otherwise or with --no-core-lease; a real `tandem serve` (tiny random model) reclaims a stale
lease, makes its own, both workers claim their slots, the decode worker logs its pool and core
set, a request is answered, and the lease is gone once the cluster has stopped. Deadlines are
bounds against a hang, never a measure of speed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.core_lease import CoreLease, Slot, lease_path
from common.shm_segments import SHM_DIR
from deploy.process_plan import free_port, plan
from deploy.local_topology import Topology
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.proc_children import child_pids
from tests.helpers.deploy_helpers import LineReader

ROOT = Path(__file__).resolve().parents[2]
START_S = 180.0  # a cold start of torch in every process on a loaded 2-core host
DEADLINE_S = 30.0


def topology(tmp_path: Path, **kw) -> Topology:
    return Topology(model="m", model_path=tmp_path / "m", log_dir=tmp_path / "logs", **kw)


def lease_flags(argv: list[str]) -> list[str]:
    i = argv.index("--core-lease") if "--core-lease" in argv else None
    return [] if i is None else argv[i:i + 4]


def test_the_plan_gives_each_worker_its_slot(tmp_path):
    t = topology(tmp_path, prefill=2, decode=1, threads=2)
    assert t.shares_cores
    assert t.core_slots() == [Slot("prefill", 2), Slot("prefill", 2), Slot("decode", 2)]
    specs, _ = plan(t, core_lease=Path("/dev/shm/tandem-cores-x-1"))
    assert [s.name for s in specs[1:]] == ["prefill-0", "prefill-1", "decode-0"]
    for slot, spec in enumerate(specs[1:]):
        assert lease_flags(spec.argv) == ["--core-lease", "/dev/shm/tandem-cores-x-1",
                                          "--core-lease-slot", str(slot)]
    assert lease_flags(specs[0].argv) == []  # the coordinator computes nothing of this
    specs, _ = plan(t)
    assert all(lease_flags(s.argv) == [] for s in specs)


@pytest.mark.parametrize("kw", [dict(colocated=True), dict(prefill=0), dict(core_lease=False)],
                         ids=["colocated", "no-prefill-workers", "no-core-lease"])
def test_no_lease_where_no_cores_are_shared(tmp_path, kw):
    assert not topology(tmp_path, **kw).shares_cores


def test_serve_parses_no_core_lease():
    from cli.main import build_parser

    assert build_parser().parse_args(["serve"]).core_lease is True
    assert build_parser().parse_args(["serve", "--no-core-lease"]).core_lease is False


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every live child of `pid`."""
    found = {}
    for child in child_pids(pid):
        try:
            found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def test_serve_makes_claims_and_removes_its_lease(tmp_path):
    tiny = make_tiny_hf_model(tmp_path / "tiny")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = CoreLease.create(lease_path("stale", int(gone.stdout)), [Slot("decode", 1)])
    stale.close()
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--model", str(tiny), "--port", str(port),
         "--grpc-port", "0", "--num-blocks", "16", "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_HOME": str(tmp_path / "home")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = LineReader(launcher)
    path = lease_path(str(port), launcher.pid)
    try:
        output.wait_for("is serving", launcher, time.monotonic() + START_S)
        # --kv-backend auto: every worker is here, on the CPU, and /dev/shm holds the pool.
        output.wait_for("  decode-0: decode_node ", launcher, time.monotonic() + DEADLINE_S)
        assert any(line.startswith("KV transfer: shm (") for line in output.seen), output.seen
        assert any(line.startswith("  decode-0: decode_node ") and "--kv-backend shm" in line
                   for line in output.seen), output.seen
        assert not stale.path.exists()
        assert any(stale.path.name in line for line in output.seen)
        lease = CoreLease.open(path)
        assert lease.slots == (Slot("prefill", 1), Slot("decode", 1))
        children = _children(launcher.pid)
        by_module = {("prefill" if "prefill_node" in cmd else "decode"): pid
                     for pid, cmd in children.items() if "_node" in cmd}
        # Each worker claimed its slot with its own pid (registration comes after the claim).
        assert [lease.pid(0), lease.pid(1)] == [by_module["prefill"], by_module["decode"]]
        most = lease.most_threads(1)
        lease.close()
        log = (tmp_path / "logs" / "decode-0.log").read_text()
        assert f"core lease {path} slot 1 (decode): native pool of {most} threads" in log
        assert "this process may run on cores [" in log
        assert f"native kernels {most}" in log
        # Each process froze what it loaded out of the cyclic GC before serving.
        for name in ("prefill-0", "decode-0", "coordinator"):
            frozen = re.search(r"(\d+) loaded objects frozen out of the cyclic GC",
                               (tmp_path / "logs" / f"{name}.log").read_text())
            assert frozen and int(frozen.group(1)) > 10_000, name
        body = json.dumps({"model": str(tiny), "prompt": "hello there", "stream": False,
                           "options": {"temperature": 0, "num_predict": 4}}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/api/generate", data=body), timeout=120) as r:
            assert json.loads(r.read())["done"] is True
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(DEADLINE_S) == 0
        assert not path.exists(), "the lease outlived its cluster"
        for name in ("prefill-0", "decode-0", "coordinator"):  # exits as clean as before
            assert "leaked" not in (tmp_path / "logs" / f"{name}.log").read_text(), name
        # The decode worker's shared-memory pool went with it.
        pool = f"tandem-kv-decode-0-{by_module['decode']}"
        assert not any(n.startswith(pool) for n in os.listdir(SHM_DIR))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(DEADLINE_S)
        for leftover in (path, stale.path):
            leftover.unlink(missing_ok=True)
    assert not any(n.startswith(f"tandem-cores-{port}-") for n in os.listdir(SHM_DIR))
