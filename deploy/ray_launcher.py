"""Place tandem's roles as processes on a Ray cluster, workers pinned by custom resources.

    ray start --head --resources='{"coordinator": 1, "prefill": 1}'      # node A
    ray start --address=A:6379 --resources='{"decode": 1}'              # node B
    python -m deploy.ray_launcher --address auto --model smollm2 --prefill 1 --decode 1

Each role is one Ray actor (`RoleProcess`, zero CPUs) scheduled by its resource: "prefill" or
"decode" (colocated workers use "decode"), and "coordinator" when the topology asks for it.
The actor picks free ports on its node, starts `python -m coordinator|prefill_node|decode_node`
there as a child process (the same commands `tandem launch` runs) with the node's IP as the
advertised address, and stops it on request. The child gets SIGTERM if the actor's process
dies, so a killed driver leaves nothing behind. The model must be in each node's own store
(`tandem pull`), as with every other launcher.

Ray carries only placement and process control; requests and KV never pass through it.

Every role listens on 0.0.0.0, so the internal plane needs a cluster secret: RayTopology
refuses to be built without one unless `insecure_internal_plane` is set. `main` hands every
process $TANDEM_CLUSTER_SECRET, or one it makes (deploy/cluster_secret.py), through the
actor's environment; `--insecure-internal-plane` starts an open plane and logs a warning.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

import ray

from common.internal_http import get_internal
from deploy.cluster_secret import ENV_SECRET, INSECURE_WARNING, cluster_secret
from deploy.local import LaunchError, log_tail
from worker.config import DEFAULT_KV_BACKEND, DEFAULT_TOKEN_BUDGET

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the actor process that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@ray.remote(num_cpus=0)
class RoleProcess:
    """One tandem process on the node this actor was placed on."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def node(self, ports: int) -> dict:
        """This node's id and IP, and `ports` ports free on it now."""
        ip = ray.util.get_node_ip_address()
        sockets = [socket.socket() for _ in range(ports)]
        try:
            for s in sockets:
                s.bind((ip, 0))
            free = [s.getsockname()[1] for s in sockets]
        finally:
            for s in sockets:
                s.close()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "ports": free}

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_die_with_parent)
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def tail(self) -> str:
        return log_tail(self.log_path)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL after grace_s; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(grace_s)
        return self.process.returncode


@dataclass(frozen=True)
class RayTopology:
    model: str  # resolved in each node's own store
    prefill: int = 1
    decode: int = 1
    colocated: bool = False  # one colocated worker per "decode" instead of prefill + decode
    kv_backend: str = DEFAULT_KV_BACKEND
    chunk_size: int = DEFAULT_TOKEN_BUDGET  # every worker's --max-batched-tokens
    prefill_threshold: int | None = None
    http_port: int = 11434  # 0 = any free port on the coordinator's node
    log_dir: str = "/tmp/tandem-ray"  # on each node
    coordinator_resources: dict[str, float] = field(default_factory=dict)
    worker_args: tuple[str, ...] = ()
    coordinator_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=lambda: {"OMP_NUM_THREADS": "1",
                                                         "OMP_WAIT_POLICY": "PASSIVE"})
    # The internal plane's secret (common/cluster_auth.py): in every process's environment
    # (TANDEM_CLUSTER_SECRET, through the actor's start), never on a command line or in a repr.
    cluster_secret: str | None = field(default=None, repr=False)
    # The operator accepts an open internal plane on 0.0.0.0 (no secret): see the docstring.
    insecure_internal_plane: bool = False

    def process_env(self) -> dict[str, str]:
        """The environment every process of the topology is started with."""
        if not self.cluster_secret:
            return dict(self.env)
        return {**self.env, ENV_SECRET: self.cluster_secret}

    def __post_init__(self) -> None:
        if self.kv_backend not in ("zmq", "grpc"):
            raise ValueError(f"kv_backend across Ray nodes must be zmq or grpc, got "
                             f"{self.kv_backend!r}")
        if self.decode < 1 or self.prefill < 0:
            raise ValueError(f"need decode >= 1 and prefill >= 0, got decode={self.decode}, "
                             f"prefill={self.prefill}")
        if not self.cluster_secret and not self.insecure_internal_plane:
            raise ValueError("refusing an internal plane on 0.0.0.0 without a cluster secret "
                             "(anyone who reaches the Registry could register as a worker and "
                             "receive users' prompts): give cluster_secret, or set "
                             "insecure_internal_plane")

    def workers(self) -> list[tuple[str, str]]:
        """(worker id, role) of every worker."""
        if self.colocated:
            return [(f"colocated-{i}", "colocated") for i in range(self.decode)]
        return ([(f"prefill-{i}", "prefill") for i in range(self.prefill)] +
                [(f"decode-{i}", "decode") for i in range(self.decode)])


@dataclass
class PlacedRole:
    name: str
    role: str
    actor: object  # RoleProcess handle
    node_id: str
    address: str  # ip:port of its gRPC server, or the coordinator's HTTP
    pid: int


class RayLauncher:
    """Start with `start()` (returns when every worker is registered), stop with `stop()`.
    Needs `ray.init(...)` first; a context manager that stops on exit."""

    def __init__(self, topology: RayTopology, start_timeout_s: float = 300.0,
                 grace_s: float = 10.0) -> None:
        self.t = topology
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.roles: list[PlacedRole] = []
        self.url = ""
        self.registry = ""

    def __enter__(self) -> RayLauncher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_coordinator()
            for name, role in self.t.workers():
                self._start_worker(name, role)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _place(self, name: str, resources: dict[str, float], ports: int):
        cls = RoleProcess.options(resources=resources) if resources else RoleProcess
        actor = cls.remote(name, self.t.log_dir)
        # Placement waits for a node with the resource; a missing resource never resolves.
        node = ray.get(actor.node.remote(ports), timeout=self.start_timeout_s)
        return actor, node

    def _start_coordinator(self) -> None:
        actor, node = self._place("coordinator", self.t.coordinator_resources, 2)
        http_port = self.t.http_port or node["ports"][1]
        argv = ["coordinator", "--model", self.t.model, "--host", "0.0.0.0",
                "--port", str(http_port), "--registry-host", "0.0.0.0",
                "--registry-port", str(node["ports"][0]), "--chunk-size", str(self.t.chunk_size)]
        if self.t.prefill_threshold is not None:
            argv += ["--prefill-threshold", str(self.t.prefill_threshold)]
        # This driver polls /internal/workers with the cluster proof (common/internal_http.py);
        # an open plane's coordinator serves it only to its own host and the networks it is told.
        driver_ip = ray.util.get_node_ip_address()
        if driver_ip != node["ip"]:
            argv += ["--internal-api-from", driver_ip]
        pid = ray.get(actor.start.remote(argv + list(self.t.coordinator_args), self.t.process_env()))
        self.url = f"http://{node['ip']}:{http_port}"
        self.registry = f"{node['ip']}:{node['ports'][0]}"
        self.roles.append(PlacedRole("coordinator", "coordinator", actor, node["node_id"],
                                     f"{node['ip']}:{http_port}", pid))

    def _start_worker(self, name: str, role: str) -> None:
        resource = "prefill" if role == "prefill" else "decode"
        actor, node = self._place(name, {resource: 1}, 2)
        module = "prefill_node" if role == "prefill" else "decode_node"
        argv = [module, "--model", self.t.model, "--host", "0.0.0.0",
                "--advertise-host", node["ip"], "--port", str(node["ports"][0]),
                "--coordinator", self.registry, "--kv-backend", self.t.kv_backend,
                "--worker-id", name, "--max-batched-tokens", str(self.t.chunk_size)]
        if module == "decode_node":
            argv += ["--role", role, "--kv-port", str(node["ports"][1])]
        pid = ray.get(actor.start.remote(argv + list(self.t.worker_args), self.t.process_env()))
        self.roles.append(PlacedRole(name, role, actor, node["node_id"],
                                     f"{node['ip']}:{node['ports'][0]}", pid))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        expected = {name for name, _ in self.t.workers()}
        last = "no answer yet"
        while True:
            for placed, code in zip(self.roles, ray.get([r.actor.poll.remote()
                                                         for r in self.roles])):
                if code is not None:
                    raise LaunchError(f"{placed.name} exited with code {code} during start-up; "
                                      f"last lines of its log on node {placed.node_id}:\n"
                                      f"{ray.get(placed.actor.tail.remote())}")
            try:
                live = {w["worker_id"] for w in get_internal(
                    self.url, self.t.cluster_secret, timeout=2)["workers"] if w["alive"]}
                if expected <= live:
                    return
                last = f"not yet registered: {', '.join(sorted(expected - live))}"
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                last = f"coordinator not answering: {exc}"
            if time.monotonic() > deadline:
                raise LaunchError(f"not ready within {self.start_timeout_s:g} s ({last})")
            time.sleep(0.25)

    def stop(self) -> None:
        """Workers first, then the coordinator; then the actors go."""
        workers = [r for r in self.roles if r.role != "coordinator"]
        coordinator = [r for r in self.roles if r.role == "coordinator"]
        for group in (workers, coordinator):
            ray.get([r.actor.stop.remote(self.grace_s) for r in group])
        for r in self.roles:
            ray.kill(r.actor)
        self.roles = []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.ray_launcher",
                                description="serve tandem on a Ray cluster until Ctrl-C")
    p.add_argument("--address", default="auto", help="Ray cluster address (ray.init)")
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--kv-backend", choices=("zmq", "grpc"), default=DEFAULT_KV_BACKEND)
    p.add_argument("--port", type=int, default=11434, help="coordinator HTTP port")
    p.add_argument("--coordinator-resource", help="custom resource the coordinator needs")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--insecure-internal-plane", action="store_true",
                   help="no cluster secret unless $TANDEM_CLUSTER_SECRET gives one: anyone who "
                        "reaches the Registry can register as a worker")
    args, worker_args = p.parse_known_args(argv)  # flags not known here go to every worker
    if args.insecure_internal_plane:
        secret = os.environ.get(ENV_SECRET, "").strip() or None
        if secret is None:
            print(INSECURE_WARNING, file=sys.stderr, flush=True)
    else:
        secret, _ = cluster_secret(os.environ)
    topology = RayTopology(
        cluster_secret=secret, insecure_internal_plane=args.insecure_internal_plane,
        model=args.model, prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        kv_backend=args.kv_backend, http_port=args.port, worker_args=tuple(worker_args),
        coordinator_resources={args.coordinator_resource: 1} if args.coordinator_resource else {})
    ray.init(address=args.address)
    stop = False

    def request_stop(*_) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with RayLauncher(topology, start_timeout_s=args.start_timeout) as launcher:
        launcher.start()
        print(f"tandem is serving {args.model} at {launcher.url} (Ollama API: "
              f"{launcher.url}/api/chat); workers register at {launcher.registry}")
        for r in launcher.roles[1:]:
            print(f"  {r.name} ({r.role}) on node {r.node_id[:12]}: grpc {r.address}")
        while not stop:
            if any(code is not None for code in ray.get([r.actor.poll.remote()
                                                         for r in launcher.roles])):
                print("a process exited; stopping")
                return 1
            time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
