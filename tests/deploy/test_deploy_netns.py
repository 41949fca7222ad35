"""`tandem launch` across network namespaces: four "hosts" (h1..h4) on a bridge in a fifth
namespace, joined by veth links (deploy/netns.sh), each with its own model cache (TANDEM_HOME).

    h1 10.77.0.1   the launcher and the coordinator (a local host to the launcher)
    h2 10.77.0.2   prefill-0     (started through `ip netns exec`, the topology's exec prefix)
    h3 10.77.0.3   decode-0      (likewise; its KV receiver listens on tcp://10.77.0.3)
    h4 10.77.0.4   decode-late   (started by hand later, as an operator adds a host)

The test process stays in the root namespace and reaches the hosts only through processes it
starts inside them. Needs root and iproute2 (.ci/run installs it); skipped only where the
kernel refuses to create a network namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.internal_http import internal_headers
from deploy.cluster_ca import issue
from tests.helpers.deploy_helpers import LineReader
from reliability.model_factory import make_tiny_gguf

NETNS_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns.sh"
SUBNET = "10.77.0"
HOSTS = 4
SMALL_WORKER = ["--kv-cache-gb", "0.05", "--decode-quant", "fp32", "--prefill-quant", "fp32"]
DEADLINE_S = 120.0

# Run inside h1: GET a path, or POST `count` concurrent chats; prints JSON.
CLIENT = r"""
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, what = sys.argv[1], sys.argv[2]
if what == "workers":  # argv[3]: the cluster proof's header, made by the test for this call
    request = urllib.request.Request(url + "/internal/workers", headers=json.loads(sys.argv[3]))
    with urllib.request.urlopen(request, timeout=10) as r:
        print(r.read().decode())
else:
    count, num_predict = int(sys.argv[3]), int(sys.argv[4])
    def chat(i):
        body = {"model": "tiny", "stream": False,
                "options": {"num_predict": num_predict, "temperature": 0},
                "messages": [{"role": "user", "content": f"Request {i}: tell me a story " * 4}]}
        req = urllib.request.Request(url + "/api/chat", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    with ThreadPoolExecutor(count) as pool:
        print(json.dumps(list(pool.map(chat, range(count)))))
"""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def require_netns() -> None:
    """Skip where namespaces cannot be created (not root, or the kernel/sandbox says EPERM)."""
    if os.geteuid() != 0:
        pytest.skip(f"creating network namespaces needs root (CAP_SYS_ADMIN); uid is "
                    f"{os.geteuid()}")
    if shutil.which("ip") is None:
        pytest.fail("iproute2 is missing: `apt-get install -y iproute2` (.ci/run does)")
    name = f"tdm-probe-{os.getpid()}"
    done = ip("netns", "add", name, check=False)
    if done.returncode != 0:
        if "Operation not permitted" in done.stderr or "Permission denied" in done.stderr:
            pytest.skip(f"this kernel/sandbox refuses network namespaces: {done.stderr.strip()}")
        pytest.fail(f"ip netns add failed: {done.stderr.strip()}")
    ip("netns", "del", name)


class Lan:
    """deploy/netns.sh's namespaces: h1..h4 with 10.77.0.1..4/24 on a bridge."""

    def __init__(self) -> None:
        self.prefix = f"tdm{os.getpid()}"
        self.names = [f"{self.prefix}-sw"] + [f"{self.prefix}-h{i}" for i in range(1, HOSTS + 1)]

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def up(self) -> None:
        done = subprocess.run(["bash", str(NETNS_SCRIPT), "up", self.prefix, str(HOSTS)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def pids(self) -> list[int]:
        pids = []
        for name in self.names:
            done = ip("netns", "pids", name, check=False)
            pids += [int(p) for p in done.stdout.split()]
        return pids

    def down(self) -> list[int]:
        """Delete the namespaces; returns the PIDs still inside them (killed here: every one
        of them was started by this test)."""
        left = self.pids()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["bash", str(NETNS_SCRIPT), "down", self.prefix], capture_output=True,
                       timeout=60)
        return left


@pytest.fixture
def lan():
    require_netns()
    lan = Lan()
    try:
        lan.up()
        yield lan
    finally:
        leftovers = lan.down()
    assert leftovers == [], f"processes were left running in the namespaces: {leftovers}"
    assert not any(name in ip("netns", "list").stdout for name in lan.names)


def in_host(lan: Lan, i: int, argv: list[str], timeout: float = 90) -> str:
    done = subprocess.run([*lan.exec_prefix(i), *argv], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


def workers(lan: Lan, url: str, secret_file: Path) -> dict[str, dict]:
    """The coordinator's worker list, asked from another host with the launch's secret (the
    route needs the cluster proof: common/internal_http.py)."""
    headers = internal_headers(secret_file.read_text().strip())
    out = in_host(lan, 1, [sys.executable, "-c", CLIENT, url, "workers", json.dumps(headers)])
    return {w["worker_id"]: w for w in json.loads(out)["workers"]}


def chats(lan: Lan, url: str, count: int, num_predict: int) -> list[dict]:
    return json.loads(in_host(lan, 1, [sys.executable, "-c", CLIENT, url, "chat", str(count),
                                       str(num_predict)]))


def write_topology(tmp_path: Path, lan: Lan, homes: dict[int, Path]) -> Path:
    def host(i: int, local: bool) -> str:
        lines = [f"[hosts.h{i}]", f'address = "{lan.address(i)}"',
                 f'env = {{ TANDEM_HOME = "{homes[i]}" }}']
        if not local:
            lines.append(f"exec = {json.dumps(lan.exec_prefix(i))}")
        return "\n".join(lines)

    text = "\n\n".join([
        "\n".join(['model = "tiny"', 'kv_backend = "zmq"', "prefill_threshold = 0",
                   "start_timeout_s = 90", f"worker_args = {json.dumps(SMALL_WORKER)}",
                   f'log_dir = "{tmp_path / "logs"}"']),
        host(1, local=True), host(2, local=False), host(3, local=False),
        '[coordinator]\nhost = "h1"\nport = 11434\nregistry_port = 50050',
        '[[prefill]]\nhost = "h2"\nport = 50061',
        '[[decode]]\nhost = "h3"\nport = 50071\nkv_port = 50081',
    ])
    path = tmp_path / "netns.toml"
    path.write_text(text + "\n")
    return path


def test_launch_across_namespaces_and_a_late_decode_worker_takes_traffic(lan, tmp_path):
    # Each host's own cache holds its own copy of the model, found by name (`tiny`).
    source = make_tiny_gguf(tmp_path / "tiny.gguf").path
    homes = {}
    for i in range(1, HOSTS + 1):
        homes[i] = tmp_path / f"home-h{i}"
        (homes[i] / "models").mkdir(parents=True)
        shutil.copy(source, homes[i] / "models" / "tiny.gguf")
    topology = write_topology(tmp_path, lan, homes)
    url = f"http://{lan.address(1)}:11434"
    deadline = time.monotonic() + DEADLINE_S

    launcher = subprocess.Popen(
        [*lan.exec_prefix(1), sys.executable, "-m", "cli.main", "launch", str(topology)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    late = None
    try:
        out = LineReader(launcher)
        out.wait_for("stop with Ctrl-C", launcher, deadline)
        assert f"decode-0 (decode) on h3: grpc {lan.address(3)}:50071, " \
               f"kv tcp://{lan.address(3)}:50081" in "".join(out.seen)

        secret_file = tmp_path / "logs" / "cluster-secret"  # launch made it (off loopback)
        before = workers(lan, url, secret_file)
        assert before["prefill-0"]["address"] == f"{lan.address(2)}:50061"
        assert before["decode-0"]["kv_endpoint"] == f"tcp://{lan.address(3)}:50081"
        # prefill_threshold = 0: every prompt is prefilled on h2 and its KV sent to h3 over TCP.
        for reply in chats(lan, url, count=2, num_predict=8):
            assert reply["done"] and reply["eval_count"] >= 1
            assert reply["tandem"]["prefill_worker"] == "prefill-0"
            assert reply["tandem"]["decode_worker"] == "decode-0"

        # A new host joins: a decode worker started there registers; nothing restarts. The
        # launch made the plane's secret and CA (off loopback: both by default), so the new
        # host gets the secret file and a certificate of that CA for its address.
        state = tmp_path / "logs"
        ca = (state / "tls" / "cluster-ca.pem", state / "tls" / "cluster-ca.key")
        joined = issue(state / "tls", ca, "late", (lan.address(4),))
        late = subprocess.Popen(
            [*lan.exec_prefix(4), "env", f"TANDEM_HOME={homes[4]}", sys.executable, "-m",
             "decode_node", "--model", "tiny", "--host", lan.address(4), "--port", "50071",
             "--coordinator", f"{lan.address(1)}:50050", "--kv-backend", "zmq",
             "--worker-id", "decode-late", "--cluster-secret-file", str(state / "cluster-secret"),
             *joined.flags(), *SMALL_WORKER],
            stdout=open(tmp_path / "decode-late.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)
        while not workers(lan, url, secret_file).get("decode-late", {}).get("alive"):
            assert late.poll() is None, (tmp_path / "decode-late.log").read_text()
            assert time.monotonic() < deadline, "decode-late never registered"
            time.sleep(0.5)
        assert workers(lan, url, secret_file)["decode-late"]["kv_endpoint"].startswith(
            f"tcp://{lan.address(4)}:")
        # Placement sends concurrent requests to the less busy decode worker, so a burst
        # reaches the new one; the launcher's processes keep running throughout.
        served_by_late = []
        while not served_by_late:
            assert time.monotonic() < deadline, "decode-late never received a request"
            replies = chats(lan, url, count=4, num_predict=32)
            assert all(r["done"] and r["eval_count"] >= 1 for r in replies), replies
            served_by_late = [r for r in replies if r["tandem"]["decode_worker"] == "decode-late"]
        assert served_by_late[0]["tandem"]["prefill_worker"] == "prefill-0"
        assert launcher.poll() is None
    finally:
        down = subprocess.run([*lan.exec_prefix(1), sys.executable, "-m", "cli.main", "launch",
                               "--down", str(topology)], capture_output=True, text=True,
                              timeout=60)
        if late is not None:
            late.terminate()
            late.wait(30)
        code = launcher.wait(30)
    assert down.returncode == 0, down.stderr
    assert "asking the launcher" in down.stdout
    assert code == 0
    assert lan.pids() == []
