"""A topology (deploy/local_topology.py) as processes: the argv, log file and environment of the
coordinator and of each worker (ProcessSpec), and what ready means (Readiness). The coordinator
gets the first spec; its Registry port is picked free here, and each worker binds port 0 and
registers the one the kernel gave it. deploy/local.py runs the specs; `tandem launch`
(deploy/launch.py) wraps them for other hosts.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local_topology import Topology

WORKER_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # "coordinator", "prefill-0", "decode-1", "colocated-0"
    argv: list[str]
    log_path: Path
    # How to signal the process when `argv` only reaches it through another program (ssh):
    # a command whose "{signal}" placeholders become TERM or KILL. Empty: signal the child.
    signal_argv: tuple[str, ...] = ()
    # Variables added to this process's environment (secrets: never on argv, never in a repr).
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Written on the process's stdin, which is then closed (a secret for the far side of ssh:
    # deploy/hosts.py); empty = stdin is /dev/null.
    stdin: bytes = field(default=b"", repr=False)
    # Descriptors the process inherits besides the lifeline (the coordinator's end of the
    # supervisor channel: deploy/model_supervisor.py).
    pass_fds: tuple[int, ...] = ()


@dataclass(frozen=True)
class Readiness:
    url: str  # the coordinator's HTTP base URL
    expected: dict[str, int]  # live workers by role
    worker_ids: tuple[str, ...] = ()  # these workers must be live too (named launches)
    # The cluster secret the poll of /internal/workers makes its proof with (common/
    # internal_http.py); None for an open plane, which the coordinator serves on its host.
    secret: str | None = field(default=None, repr=False)
    # More coordinators' URLs (tandem launch's [[coordinator]] tables), each of which must
    # report the workers too. Invariant: the plan's first 1 + len(more_urls) processes are the
    # coordinators, in the order of `urls`.
    more_urls: tuple[str, ...] = ()

    @property
    def urls(self) -> tuple[str, ...]:
        return (self.url, *self.more_urls)



def free_port() -> int:
    with socket.socket() as s:
        s.bind((WORKER_HOST, 0))
        return s.getsockname()[1]


def _named_ports(args: tuple[str, ...]) -> set[int]:
    """The values of `--*-port N` flags the caller gives the coordinator (its gRPC API port)."""
    return {int(v) for flag, v in zip(args, args[1:]) if flag.endswith("-port") and v.isdigit()}


def plan(t: Topology, port_picker: Callable[[], int] = free_port,
         core_lease: Path | None = None) -> tuple[list[ProcessSpec], Readiness]:
    """Every process's spec; `core_lease`: the lease file made for t.core_slots(), which
    every worker then gets with its slot."""
    # A port picked free is free only until its owner binds it: two picks (the caller's HTTP
    # port, this registry port) can return the same one, and then one bind fails.
    taken = {t.port, *_named_ports(t.coordinator_args)}
    registry_port = port_picker()
    while registry_port in taken:
        registry_port = port_picker()
    coordinator = [sys.executable, "-m", "coordinator",
                   *(a for name, _ in t.models for a in ("--model", name)),
                   "--host", t.host, "--port", str(t.port),
                   "--registry-host", WORKER_HOST, "--registry-port", str(registry_port),
                   *t.coordinator_flags(), *t.auth_args,
                   *(("--load-on-request",) if t.load_on_request else ())]
    cluster = (("TANDEM_CLUSTER_SECRET", t.cluster_secret),) if t.cluster_secret else ()
    secrets = ((("TANDEM_API_KEY", t.api_key),) if t.api_key else ()) + cluster
    if t.api_tls:
        coordinator += ["--api-tls-cert", t.api_tls[0], "--api-tls-key", t.api_tls[1]]
    specs = [ProcessSpec("coordinator", coordinator + list(t.coordinator_args),
                         t.log_dir / "coordinator.log", env=secrets)]
    counters: dict[tuple[int, str], int] = {}
    for slot, (model_index, model_path, role, module) in enumerate(t.worker_roles()):
        index = counters[model_index, role] = counters.get((model_index, role), -1) + 1
        name = f"{t.worker_prefix(model_index)}{role}-{index}"
        specs.append(worker_spec(t, name, model_path, role, module, registry_port,
                                 (core_lease, slot) if core_lease is not None else None))
    host = "127.0.0.1" if t.host in ("0.0.0.0", "::", "") else t.host
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    scheme = "https" if t.api_tls else "http"
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two workers would have one name ({', '.join(names[1:])}): give the "
                         "models names that differ in their letters and digits")
    # With several models, counts by role could be met by one model's workers: name them all.
    named = tuple(names[1:]) if t.more_models else ()
    return specs, Readiness(f"{scheme}://{host}:{t.port}", t.expected_workers(), named,
                            secret=t.cluster_secret)


def worker_spec(t: Topology, name: str, model_path: Path, role: str, module: str,
                registry_port: int, lease_slot: tuple[Path, int] | None = None) -> ProcessSpec:
    """One worker's spec: `name` serving `model_path` as `role` (module: prefill_node or
    decode_node), registering at the coordinator's Registry port; `lease_slot`: (core lease
    file, its slot), or None."""
    argv = [sys.executable, "-m", module, "--model", str(model_path),
            # Port 0: each worker binds one the kernel picks and registers it, so a worker
            # never races another bind for a port picked free here.
            "--host", WORKER_HOST, "--port", "0",
            "--coordinator", f"{WORKER_HOST}:{registry_port}",
            "--kv-backend", t.kv_backend, "--worker-id", name, *t.worker_flags(role),
            *t.auth_args]
    if module == "decode_node":
        argv += ["--role", role]
    if lease_slot is not None:
        argv += ["--core-lease", str(lease_slot[0]), "--core-lease-slot", str(lease_slot[1])]
    argv += list(t.worker_args)
    cluster = (("TANDEM_CLUSTER_SECRET", t.cluster_secret),) if t.cluster_secret else ()
    return ProcessSpec(name, argv, t.log_dir / f"{name}.log", env=cluster)


def registry_port_of(coordinator: ProcessSpec) -> int:
    """The Registry port plan() gave the coordinator (where workers started later register)."""
    return int(coordinator.argv[coordinator.argv.index("--registry-port") + 1])
