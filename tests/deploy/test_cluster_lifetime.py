"""No process of a cluster outlives its launcher, and no shared-memory KV pool outlives its
cluster: SIGHUP, SIGTERM and SIGKILL of a real `tandem serve` (tiny random model, shm KV
backend) and SIGKILL of a real `tandem launch`; a second cluster on a held port fails at start,
naming the port. Deadlines here are bounds against a hang, never a measure of speed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.processes import start_time
from common.shm_segments import SHM_DIR, owner_pid, reclaim_orphans
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.proc_children import child_pids
from tests.helpers.deploy_helpers import LineReader, free_port_block

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0  # against a hang
START_S = 180.0  # a cold start of torch in every process on a loaded 2-core host


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_hf_model(tmp_path_factory.mktemp("model") / "tiny")


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_HOME": str(home)}


def _start(argv: list[str], home: Path) -> tuple[subprocess.Popen, LineReader]:
    process = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], cwd=ROOT,
                               env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    return process, LineReader(process)


def _serve_argv(model: Path, port: int, log_dir: Path, *extra: str) -> list[str]:
    return ["serve", "--model", str(model), "--port", str(port), "--grpc-port", "0",
            "--kv-backend", "shm", "--num-blocks", "16", "--log-dir", str(log_dir), *extra]


def _children(pid: int) -> dict[int, int]:
    """pid -> start time of every live child of `pid`."""
    starts = {child: start_time(child) for child in child_pids(pid)}
    return {child: start for child, start in starts.items() if start is not None}


def _segments(pids) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if owner_pid(n) in set(pids))


def _wait_clean(processes: dict[int, int], deadline: float) -> tuple[list[int], list[str]]:
    """Poll until every process is gone and none of their segments is left."""
    while True:
        alive = [p for p, start in processes.items() if start_time(p) == start]
        left = _segments(processes)
        if (not alive and not left) or time.monotonic() > deadline:
            return alive, left
        time.sleep(0.2)


def _kill_all(launcher: subprocess.Popen, processes: dict[int, int]) -> None:
    for pid, start in processes.items():
        if start_time(pid) == start:
            os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        launcher.kill()
    launcher.wait(DEADLINE_S)
    for name in _segments(processes):
        os.unlink(os.path.join(SHM_DIR, name))


@pytest.mark.parametrize("sig, layout", [
    (signal.SIGHUP, ["--colocated"]),
    (signal.SIGTERM, ["--prefill", "1", "--decode", "1"]),
    (signal.SIGKILL, ["--colocated"]),
    (signal.SIGKILL, ["--prefill", "1", "--decode", "1"]),
], ids=["hup-colocated", "term-disaggregated", "kill-colocated", "kill-disaggregated"])
def test_serve_leaves_no_process_and_no_segment(tiny, tmp_path, sig, layout):
    port = free_port()
    launcher, output = _start(_serve_argv(tiny, port, tmp_path / "logs", *layout), tmp_path / "home")
    processes: dict[int, int] = {}
    try:
        output.wait_for("is serving", launcher, time.monotonic() + START_S)
        processes = _children(launcher.pid)
        assert len(processes) == (2 if "--colocated" in layout else 3)
        assert _segments(processes), "an shm decode worker makes its KV pool in /dev/shm"
        # Each in a process group of its own, all in the launcher's session: one scheduling
        # group where the kernel's autogroup is on (deploy/local.py OWN_PROCESS_GROUP; Python
        # 3.10 has no process_group and keeps a session each).
        assert all(os.getpgid(p) == p for p in processes)
        if sys.version_info >= (3, 11):
            assert all(os.getsid(p) == os.getsid(launcher.pid) for p in processes)
        if sig == signal.SIGTERM:
            # A second cluster on the port the first holds fails at start and names it.
            second = subprocess.run(
                [sys.executable, "-m", "cli.main",
                 *_serve_argv(tiny, port, tmp_path / "logs2", "--colocated")],
                cwd=ROOT, env=_env(tmp_path / "home"), capture_output=True, text=True,
                timeout=DEADLINE_S * 4)
            assert second.returncode != 0
            assert f"port {port}" in second.stderr and f"pid {launcher.pid}" in second.stderr
        os.kill(launcher.pid, sig)
        alive, left = _wait_clean(processes, time.monotonic() + DEADLINE_S)
        assert alive == [] and left == [], output.seen
        assert launcher.wait(DEADLINE_S) is not None
        if sig != signal.SIGKILL:
            output.wait_for("stopped ", launcher, time.monotonic() + DEADLINE_S)
            assert launcher.returncode == 0
            assert any(signal.Signals(sig).name in line for line in output.seen)
        else:  # the workers saw their lifeline break
            logs = " ".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
            assert "the launcher that started this process is gone" in logs
    finally:
        _kill_all(launcher, processes)


def test_a_port_held_by_anything_else_is_named_with_its_pid(tiny, tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "cli.main",
                               *_serve_argv(tiny, port, tmp_path / "logs", "--colocated")],
                              cwd=ROOT, env=_env(tmp_path / "home"), capture_output=True,
                              text=True, timeout=DEADLINE_S * 4)
    assert done.returncode != 0
    assert f"port {port} is in use on 127.0.0.1 by pid {os.getpid()}" in done.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_launch_killed_leaves_no_process_and_no_segment_and_holds_its_ports(tiny, tmp_path):
    p = free_port_block()
    text = f"""
model = "{tiny}"
kv_backend = "shm"
worker_args = ["--num-blocks", "16"]
[coordinator]
host = "127.0.0.1"
port = {p}
registry_port = {p + 1}
[[colocated]]
host = "127.0.0.1"
port = {p + 2}
"""
    (tmp_path / "a.toml").write_text(text)
    (tmp_path / "b.toml").write_text(text)  # another file, the same ports
    launcher, output = _start(["launch", str(tmp_path / "a.toml"), "--state-dir",
                               str(tmp_path / "state-a")], tmp_path / "home")
    processes: dict[int, int] = {}
    try:
        output.wait_for("stop with Ctrl-C", launcher, time.monotonic() + START_S)
        processes = _children(launcher.pid)
        assert len(processes) == 2 and _segments(processes)
        second = subprocess.run([sys.executable, "-m", "cli.main", "launch",
                                 str(tmp_path / "b.toml"), "--state-dir", str(tmp_path / "state-b")],
                                cwd=ROOT, env=_env(tmp_path / "home"), capture_output=True,
                                text=True, timeout=DEADLINE_S * 4)
        assert second.returncode != 0
        assert f"port {p}" in second.stderr and f"pid {launcher.pid}" in second.stderr
        os.kill(launcher.pid, signal.SIGKILL)
        alive, left = _wait_clean(processes, time.monotonic() + DEADLINE_S)
        assert alive == [] and left == [], output.seen
    finally:
        _kill_all(launcher, processes)


# ---- the pieces, without processes of a cluster -------------------------------------------------

def test_orphan_segments_are_reclaimed_and_live_ones_kept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(DEADLINE_S)
    mine = os.getpid()
    names = {f"tandem-kv-decode-0-{gone.pid}": True, f"tandem-kv-decode-0-{gone.pid}-own": True,
             f"tandem-kv-decode-1-{mine}": False, f"tandem-kv-decode-1-{mine}-own": False,
             f"tandem-kv-decode-2-{mine}": True,  # older than this process: its pid was reused
             "tandem-other-123": False}
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 8)
    os.utime(tmp_path / f"tandem-kv-decode-2-{mine}", (1e9, 1e9))
    assert reclaim_orphans(owners=[12345678], directory=str(tmp_path)) == []
    removed = reclaim_orphans(directory=str(tmp_path))
    assert sorted(removed) == sorted(n for n, orphan in names.items() if orphan)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, orphan in names.items() if not orphan)


def test_a_second_signal_kills_at_once(tmp_path):
    """A child that ignores SIGTERM is killed by the second SIGTERM, long before its grace."""
    script = f"""
import signal, sys
from pathlib import Path
from deploy.local import LocalCluster, run_until_stopped
from deploy.process_plan import ProcessSpec, Readiness
stubborn = ProcessSpec("coordinator", [sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
    Path({str(tmp_path / 'c.log')!r}))
cluster = LocalCluster([stubborn], Readiness("http://127.0.0.1:1", {{}}), grace_s=600)
sys.exit(run_until_stopped(cluster, lambda: None, lambda line: print(line, flush=True)))
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    output = LineReader(launcher)
    processes: dict[int, int] = {}
    try:
        deadline = time.monotonic() + DEADLINE_S
        while "up" not in (tmp_path / "c.log").read_text() if (tmp_path / "c.log").exists() else True:
            assert time.monotonic() < deadline and launcher.poll() is None, output.seen
            time.sleep(0.1)
        processes = _children(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        output.wait_for("SIGTERM: stopping", launcher, time.monotonic() + DEADLINE_S)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(DEADLINE_S * 4) == 130  # interrupted during start-up
        output.wait_for("stopped coordinator (pid", launcher, time.monotonic() + DEADLINE_S)
        assert any("exit -9" in line for line in output.seen)
        assert any("SIGTERM again: killing every process now" in line for line in output.seen)
    finally:
        _kill_all(launcher, processes)


def test_a_worker_that_loses_its_coordinator_gives_up_after_its_retry_time():
    import asyncio

    from common.rpc import worker_pb2 as pb
    from worker.node_server import NodeFailure, NodeIdentity, register_and_heartbeat

    identity = NodeIdentity("decode-0", "decode", "127.0.0.1:1", "", "zmq", "fp", "layout")
    nobody = f"127.0.0.1:{free_port()}"

    async def run() -> None:
        await asyncio.wait_for(register_and_heartbeat(nobody, identity, pb.WorkerStatus,
                                                      asyncio.Event(), retry_s=0.5), DEADLINE_S)

    with pytest.raises(NodeFailure, match=f"coordinator {nobody} unreachable for"):
        asyncio.run(run())
