"""`tandem launch` through its SSH path, with `ssh` on PATH replaced by a script that runs the
remote command here (no sshd, no network). What is real: the remote shell command (quoting,
the host's env, the PID file written before exec), readiness, and `--down` stopping each role
through `ssh HOST kill -TERM $(cat PIDFILE)`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reliability.model_factory import make_tiny_gguf
from tests.helpers.deploy_helpers import LineReader, free_port_block

FAKE_SSH = """#!/bin/sh
# ssh [options] DESTINATION COMMAND: run COMMAND here, as sshd would run it on DESTINATION.
for last; do :; done
echo "$*" >> "$(dirname "$0")/calls.log"
exec sh -c "$last"
"""
SMALL_WORKER = ["--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_roles_started_over_ssh_serve_and_stop_through_their_pid_files(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    home = tmp_path / "home with space"
    (home / "models").mkdir(parents=True)
    make_tiny_gguf(home / "models" / "tiny.gguf")
    p = free_port_block()
    topology = tmp_path / "ssh.toml"
    topology.write_text(f"""
model = "tiny"
prefill_threshold = 0
worker_args = {json.dumps(SMALL_WORKER)}
log_dir = "{tmp_path / 'logs'}"
[hosts.far]
address = "127.0.0.1"
bind = "0.0.0.0"  # off loopback: a secret and TLS by default, both over ssh's stdin
ssh = "tandem@far"
python = "{sys.executable}"
env = {{ TANDEM_HOME = "{home}" }}
[coordinator]
host = "far"
port = {p}
registry_port = {p + 1}
[[prefill]]
host = "far"
port = {p + 2}
[[decode]]
host = "far"
port = {p + 3}
kv_port = {p + 4}
""")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    launcher = subprocess.Popen([sys.executable, "-m", "cli.main", "launch", str(topology)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
    run_dirs = []
    try:
        LineReader(launcher).wait_for("stop with Ctrl-C", launcher, time.monotonic() + 90)
        run_dirs = list(Path("/tmp").glob(f"tandem-launch-{launcher.pid}-*"))
        [run_dir] = run_dirs
        pids = {f.stem: int(f.read_text()) for f in run_dir.glob("*.pid")}
        assert set(pids) == {"coordinator", "prefill-0", "decode-0"}
        assert all(alive(pid) for pid in pids.values())
        # The secret the launch made reached each remote process on ssh's stdin: in its
        # environment, on no command line on either side.
        secret = (tmp_path / "logs" / "cluster-secret").read_text().strip()
        assert (tmp_path / "logs" / "cluster-secret").stat().st_mode & 0o777 == 0o600
        for pid in pids.values():
            assert f"TANDEM_CLUSTER_SECRET={secret}".encode() in Path(
                f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret not in (bin_dir / "calls.log").read_text()
        # ... and so did its host's TLS files: written 0600 in a 0700 folder per role there.
        for name, pid in pids.items():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            cert = Path(argv[argv.index("--tls-cert") + 1])
            assert cert == run_dir / f"tls-{name}" / "cert.pem"
            assert cert.parent.stat().st_mode & 0o777 == 0o700
            assert all(f.stat().st_mode & 0o777 == 0o600 for f in cert.parent.iterdir())
        assert b"PRIVATE KEY" not in (bin_dir / "calls.log").read_bytes()
        with grpc.insecure_channel(f"127.0.0.1:{p + 3}") as channel:  # plaintext: refused
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)

        body = {"model": "tiny", "stream": False, "options": {"num_predict": 4, "temperature": 0},
                "messages": [{"role": "user", "content": "Tell me about the sea. " * 4}]}
        req = urllib.request.Request(f"http://127.0.0.1:{p}/api/chat",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        assert reply["tandem"]["prefill_worker"] == "prefill-0"
        assert reply["tandem"]["decode_worker"] == "decode-0"
    finally:
        down = subprocess.run([sys.executable, "-m", "cli.main", "launch", "--down",
                               str(topology)], capture_output=True, text=True, env=env,
                              timeout=90)
        code = launcher.wait(60)
    assert down.returncode == 0 and code == 0, down.stderr
    calls = (bin_dir / "calls.log").read_text().splitlines()
    # One probe, three starts, and one kill per role through its PID file.
    assert sum("deploy.probe" in c for c in calls) == 1
    assert sum("kill -TERM" in c for c in calls) == 3
    assert all("tandem@far" in c and "BatchMode=yes" in c for c in calls)
    assert [name for name, pid in pids.items() if alive(pid)] == []
    for run_dir in run_dirs:
        shutil.rmtree(run_dir)


def test_security_files_missing_on_an_ssh_host_stop_the_launch_before_anything_starts(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    make_tiny_gguf(home / "models" / "tiny.gguf")
    missing = tmp_path / "etc tandem" / "ca.pem"  # a space: the remote command quotes it
    p = free_port_block()
    topology = tmp_path / "ssh.toml"
    topology.write_text(f"""
model = "tiny"
log_dir = "{tmp_path / 'logs'}"
[security]
cluster_secret_file = "{tmp_path / 'secret'}"
tls_cert = "{missing}"
tls_key = "{missing}"
tls_ca = "{missing}"
[hosts.far]
address = "127.0.0.1"
ssh = "tandem@far"
python = "{sys.executable}"
env = {{ TANDEM_HOME = "{home}" }}
[coordinator]
host = "far"
port = {p}
registry_port = {p + 1}
[[decode]]
host = "far"
port = {p + 3}
kv_port = {p + 4}
""")
    (tmp_path / "secret").write_text("correct horse battery staple 42\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-m", "cli.main", "launch", str(topology)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert ("host 'far' (127.0.0.1, via ssh tandem@far): [security]: TLS cert file "
            f"{missing} does not exist on that host") in done.stderr
    calls = (bin_dir / "calls.log").read_text().splitlines()
    assert len(calls) == 1 and "deploy.probe" in calls[0]  # the probe only: no role started
    assert not (tmp_path / "logs").exists()
