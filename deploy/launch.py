"""`tandem launch TOPOLOGY.toml`: start every role of a multi-host topology on its host.

    topology = load_topology(path)        # file errors: TopologyError, nothing started
    pull_everywhere(topology)             # optional (--pull): `tandem pull` on every host
    preflight(topology)                   # each host: reachable? model there and identical?
                                          #   ports free? [security] files there and valid?
                                          #   (TopologyError, nothing started)
    launch(topology, state_dir, os.environ)   # the secret (launch_secret), then the coordinator,
                                          #   then workers; wait until every named
                                          #   worker is live; print endpoints; serve until
                                          #   Ctrl-C/SIGTERM or `tandem launch --down`
    down(topology, state_dir)             # from another shell: stop what launch started

Processes are started from this machine: locally, through a host's command prefix, or over
SSH (deploy/hosts.py), with their output in `state_dir/<role>.log` here. The launch records
itself and its processes in `state_dir/launch.json`; `down` asks the launcher to stop (it stops
workers first, then the coordinator), and stops the recorded processes itself when the
launcher is gone. Workers register with the coordinator (with every one, where the topology
has [[coordinator]] tables: coordinators first in the plan, each polled for readiness), so a
worker started later anywhere with `--coordinator <registry address[es]>` takes traffic
without restarting anything (with
`--cluster-secret-file` of the launch's secret: `state_dir/cluster-secret` when it made one).

The internal plane is authenticated by default: without [security] cluster_secret_file, every
process gets a secret in its environment (the operator's $TANDEM_CLUSTER_SECRET, else one made
for the launch; over SSH on the remote shell's stdin: deploy/hosts.py). A topology that
listens off loopback without a secret is refused unless it says insecure_internal_plane.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.internal_http import get_internal
from common.processes import start_time
from deploy.cluster_ca import Issued
from deploy.cluster_secret import ENV_SECRET, INSECURE_WARNING, SECRET_FILE, write_secret_file
from deploy.hosts import host_command, python_of, role_command, stdin_lines
from deploy.local import LocalCluster, run_until_stopped
from deploy.process_plan import ProcessSpec, Readiness
from deploy.plane_security import check_internal_plane, launch_secret, launch_tls
from deploy.ports import claim_ports
from deploy.topology import ClusterTopology, Host, Role, TopologyError

PROBE_TIMEOUT_S = 60.0
PULL_TIMEOUT_S = 1800.0
STATE_FILE = "launch.json"


# ---- before anything starts ---------------------------------------------------------------------

def preflight(t: ClusterTopology) -> dict[str, dict]:
    """Probe every host at once; TopologyError listing every problem found. Returns each host's
    probe answer by host name."""
    listen: dict[str, list[str]] = {h.name: [] for h in t.hosts}
    for role in t.roles:
        listen[role.host.name] += [f"{role.host.bind}:{port}" for _, port in role.ports()]
    with ThreadPoolExecutor(max_workers=max(1, len(t.hosts))) as pool:
        answers = dict(zip([h.name for h in t.hosts],
                           pool.map(lambda h: _probe(h, t.models_on(h), listen[h.name],
                                                     t.auth_args), t.hosts)))
    problems = [a for a in answers.values() if isinstance(a, str)]
    # Each model's fingerprint per host that needs it (t.models_on): one per model, or its
    # workers would be refused at registration.
    fingerprints: dict[str, dict[str, list[str]]] = {m: {} for m in t.models}
    for host in t.hosts:
        answer = answers[host.name]
        if isinstance(answer, str):
            continue
        for name, model in zip(t.models_on(host), answer.get("models", [answer["model"]])):
            if "error" in model:
                problems.append(f"{host.describe()}: model {name!r} is not available there: "
                                f"{model['error']} (run `tandem pull {name}` on that host)")
            else:
                fingerprints[name].setdefault(model["fingerprint"], []).append(
                    f"{host.name} ({model['path']})")
        problems += [f"{host.describe()}: {why}" for why in answer["listen"]]
        if answer.get("auth"):  # a probe of an older tandem reports no "auth"
            problems.append(f"{host.describe()}: [security]: {answer['auth']} on that host")
    for name, seen in fingerprints.items():
        if len(seen) > 1:
            listed = "; ".join(f"{fp} on {', '.join(hosts)}" for fp, hosts in seen.items())
            problems.append(f"mismatched model: {name!r} is not the same model on every host "
                            f"({listed}); workers of another model would be refused at "
                            "registration. Pull the same model on every host.")
    if problems:
        raise TopologyError(f"{t.source}: cannot launch, nothing was started:\n  - "
                            + "\n  - ".join(problems))
    return answers


def pull_everywhere(t: ClusterTopology, out: Callable[[str], None] = print) -> None:
    """`tandem pull MODEL` on every host at once, of each model the host's roles need
    (t.models_on), each into its own cache (a no-op where the model is already there and
    verified); TopologyError naming the hosts where it failed."""
    def pull(host: Host, model: str) -> str | None:
        command = host_command(host, [python_of(host), "-m", "cli.main", "pull", model])
        try:
            done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=PULL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{host.describe()}: cannot pull {model!r}: {exc}"
        if done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            return f"{host.describe()}: `tandem pull {model}` failed: {detail}"
        out(f"{host.name}: {done.stdout.strip()}")
        return None

    def pull_all(host: Host) -> list[str]:
        return [p for p in (pull(host, m) for m in t.models_on(host)) if p]

    with ThreadPoolExecutor(max_workers=max(1, len(t.hosts))) as pool:
        problems = [p for found in pool.map(pull_all, t.hosts) for p in found]
    if problems:
        raise TopologyError(f"{t.source}: cannot launch, nothing was started:\n  - "
                            + "\n  - ".join(problems))


def _probe(host: Host, models: tuple[str, ...], listen: list[str],
           auth_args: tuple[str, ...] = ()) -> dict | str:
    argv = [python_of(host), "-m", "deploy.probe",
            *(a for m in models for a in ("--model", m)), *auth_args]
    for item in listen:
        argv += ["--listen", item]
    command = host_command(host, argv)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"{host.describe()} is unreachable: {command[0]!r} is not installed here"
    except subprocess.TimeoutExpired:
        return f"{host.describe()} is unreachable: no answer within {PROBE_TIMEOUT_S:g} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    detail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    if host.kind == "ssh" and done.returncode == 255:
        return f"{host.describe()} is unreachable: {detail}"
    return (f"{host.describe()} is unreachable: `{' '.join(command[:4])} ...` exited with code "
            f"{done.returncode}: {detail} (is tandem installed there, and is its python "
            f"{python_of(host)!r}?)")


# ---- what runs where ----------------------------------------------------------------------------

def plan_launch(t: ClusterTopology, log_dir: Path, run_id: str, secret: str | None = None,
                tls: dict[str, Issued] | None = None) -> tuple[list[ProcessSpec], Readiness]:
    """Every role's command on its host. `secret` goes into each one's environment and `tls`
    (launch_tls, by host name) gives each its host's --tls-* files: local paths here and
    through a prefix; over ssh both come on the remote shell's stdin, the files written 0600
    in the run folder there (deploy/hosts.py). TopologyError (check_internal_plane) for an
    open plane off loopback."""
    check_internal_plane(t, secret)
    remote_run_dir = f"/tmp/tandem-launch-{run_id}"
    extra_env = {"PYTHONUNBUFFERED": "1"}
    specs = []
    for role in t.roles:  # coordinators first (Readiness.more_urls)
        issued = tls[role.host.name] if tls else None
        ssh = role.host.kind == "ssh"
        files = (issued.cert, issued.key, issued.ca) if issued else ()
        # Over ssh each role gets its own copy, so two roles of a host never write one file.
        remote = tuple(f"{remote_run_dir}/tls-{role.name}/{n}"
                       for n in ("cert.pem", "key.pem", "ca.pem")) if issued else ()
        paths = remote if ssh else tuple(map(str, files))
        tls_flags = [f for flag, path in zip(("--tls-cert", "--tls-key", "--tls-ca"), paths)
                     for f in (flag, path)]
        argv = [python_of(role.host), "-m", *_role_argv(t, role), *tls_flags]
        values = (secret,) if ssh and secret else ()
        command, signal_argv = role_command(role.host, argv, remote_run_dir, role.name, extra_env,
                                            stdin_env=(ENV_SECRET,) if values else (),
                                            stdin_files=remote if ssh else ())
        env = ((ENV_SECRET, secret),) if secret and not ssh else ()
        stdin = stdin_lines(values, files) if ssh and (values or files) else b""
        specs.append(ProcessSpec(role.name, command, log_dir / f"{role.name}.log", signal_argv,
                                 env=env, stdin=stdin))
    return specs, Readiness(t.url, t.expected_workers(), tuple(w.name for w in t.workers),
                            secret=secret or _local_secret(t), more_urls=t.urls[1:])


def _local_secret(t: ClusterTopology) -> str | None:
    """[security] cluster_secret_file's secret where this host has that file (each host reads
    its own copy): the readiness poll's proof needs it. None where it has not: the poll is
    refused, and the start-up times out naming the 403."""
    if not t.secret_file:
        return None
    try:
        return Path(t.secret_file).read_text().strip() or None
    except OSError:
        return None


def _internal_api_from(t: ClusterTopology, coordinator: Role) -> list[str]:
    """Without a cluster secret, a coordinator on another host answers /internal/workers (the
    launcher's readiness poll) only to the networks it is told: every host address of the
    topology, where the launcher runs (the same host as the coordinator needs nothing). With a
    secret the poll's proof is what opens it (common/internal_http.py); the flags are inert."""
    if coordinator.host.kind == "local":
        return []
    flags = []
    for address in sorted({h.address for h in t.hosts}):
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:  # a host name: the operator adds --internal-api-from if needed
            continue
        flags += ["--internal-api-from", f"{ip}/{ip.max_prefixlen}"]
    return flags


def _role_argv(t: ClusterTopology, role: Role) -> list[str]:
    host = role.host
    if role.role == "coordinator":
        argv = ["coordinator", *(a for m in t.models for a in ("--model", m)),
                "--host", host.bind, "--port", str(role.port),
                "--registry-host", host.bind, "--registry-port", str(role.registry_port),
                "--chunk-size", str(t.chunk_size)]
        if role.grpc_port:
            argv += ["--grpc-host", host.bind, "--grpc-port", str(role.grpc_port)]
        if t.prefill_threshold is not None:
            argv += ["--prefill-threshold", str(t.prefill_threshold)]
        return (argv + _internal_api_from(t, role) + list(t.auth_args) + list(t.coordinator_args)
                + list(role.args))
    module = "prefill_node" if role.role == "prefill" else "decode_node"
    argv = [module, "--model", role.model or t.model, "--host", host.bind,
            "--advertise-host", host.address,
            "--port", str(role.port), "--coordinator", t.registry_address,
            "--kv-backend", t.kv_backend, "--worker-id", role.name,
            "--max-batched-tokens", str(t.chunk_size)]
    if module == "decode_node":
        argv += ["--role", role.role]
        if role.kv_port:
            argv += ["--kv-port", str(role.kv_port)]
    return argv + list(t.auth_args) + list(t.worker_args) + list(role.args)


# ---- run and stop -------------------------------------------------------------------------------

def launch(t: ClusterTopology, state_dir: Path, env: Mapping[str, str] | None = None, *,
           out: Callable[[str], None] = print, check: bool = True, grace_s: float = 10.0,
           lock_dir: Path | None = None) -> int:
    """Start, serve until stopped, stop. 0 on a requested stop, 1 if a process failed. The
    ports of roles on this host are claimed first (deploy/ports.py, locks in `lock_dir`).
    Every process gets launch_secret's secret (the operator's from `env`, else a new one)."""
    state_path = state_dir / STATE_FILE
    if _launcher_alive(_read_state(state_path)):
        raise TopologyError(f"{t.source} is already launched (state in {state_path}); stop it "
                            f"with `tandem launch --down {t.source}`")
    secret, made = launch_secret(t, env or {})
    check_internal_plane(t, secret)  # before anything is probed or started
    if t.off_loopback and not (secret or t.secret_file):
        out(INSECURE_WARNING)
    local = [port for role in t.roles if role.host.kind == "local"
             for _, port in role.ports()]
    with claim_ports(lock_dir, local, None):  # the preflight test-binds each address
        if check:
            preflight(t)
        # Only now: a launch refused by its preflight leaves nothing behind.
        if made:
            path = write_secret_file(state_dir / SECRET_FILE, secret)
            out(f"made a cluster secret for this launch in {path} (0600); a worker started "
                f"later joins with --cluster-secret-file holding it")
        tls = launch_tls(t, state_dir)
        if tls:
            out(f"made a CA and a certificate per host in {state_dir / 'tls'} (0600): the "
                f"internal gRPC plane is mutual TLS")
        return _launch(t, state_dir, secret, tls, out, grace_s)


def _launch(t: ClusterTopology, state_dir: Path, secret: str | None,
            tls: dict[str, Issued] | None, out: Callable[[str], None], grace_s: float) -> int:
    state_path = state_dir / STATE_FILE
    run_id = f"{os.getpid()}-{int(time.time())}"
    specs, ready = plan_launch(t, state_dir, run_id, secret, tls)
    cluster = LocalCluster(specs, ready, start_timeout_s=t.start_timeout_s, grace_s=grace_s)

    def record() -> None:
        processes = [{"name": c.spec.name, "pid": c.process.pid,
                      "start": start_time(c.process.pid), "signal_argv": c.spec.signal_argv}
                     for c in cluster.children]
        state = {"topology": str(t.source), "launcher_pid": os.getpid(),
                 "launcher_start": start_time(os.getpid()), "processes": processes}
        state_path.write_text(json.dumps(state, indent=1))

    state_dir.mkdir(parents=True, exist_ok=True)
    out(f"starting {', '.join(s.name for s in specs)}; logs in {state_dir}")
    try:
        return run_until_stopped(cluster, lambda: _print_endpoints(t, ready.secret, out), out,
                                 on_spawn=record)
    finally:
        state_path.unlink(missing_ok=True)


def _print_endpoints(t: ClusterTopology, secret: str | None, out: Callable[[str], None]) -> None:
    try:
        workers = {w["worker_id"]: w for w in get_internal(t.url, secret)["workers"]}
    except (OSError, ValueError, KeyError):
        workers = {}  # a process that just died is reported by the serving loop
    out(f"tandem is serving {', '.join(t.models)} at {t.url}  (Ollama API: {t.url}/api/chat, "
        f"metrics: {t.url}/metrics); workers register at {t.registry_address}")
    if len(t.urls) > 1:
        # Each coordinator serves on its own: a client that fails over along this list (or a
        # TCP load balancer over it) keeps being served while one is down.
        out(f"  {len(t.urls)} coordinators, each serving every request on its own; clients "
            f"use the list: {','.join(t.urls)}")
    for role in t.workers:
        w = workers.get(role.name, {})
        address = w.get("address") or f"{role.host.address}:{role.port}"
        kv = f", kv {w['kv_endpoint']}" if w.get("kv_endpoint") else ""
        out(f"  {role.name} ({role.role}) on {role.host.name}: grpc {address}{kv}")
    out(f"stop with Ctrl-C or `tandem launch --down {t.source}`")


def down(t: ClusterTopology, state_dir: Path, *, out: Callable[[str], None] = print,
         timeout_s: float = 60.0, grace_s: float = 10.0) -> int:
    """Stop what `launch` started from this topology; 0 when nothing is left running."""
    state_path = state_dir / STATE_FILE
    state = _read_state(state_path)
    if state is None:
        out(f"nothing to stop: no launch of {t.source} is recorded in {state_dir}")
        return 0
    pid = state["launcher_pid"]
    if _launcher_alive(state):
        out(f"asking the launcher (pid {pid}) to stop every process")
        os.kill(pid, signal.SIGTERM)
        if _wait_gone(pid, state["launcher_start"], timeout_s):
            out("stopped")
            return 0
        out(f"the launcher did not stop within {timeout_s:g} s; stopping its processes")
    # The launcher is gone (killed, crashed): stop the recorded processes, workers first.
    processes = state["processes"]
    coordinators = [p for p in processes if p["name"].startswith("coordinator")]
    for group in ([p for p in processes if p not in coordinators], coordinators):
        for p in group:
            _signal_recorded(p, signal.SIGTERM, grace_s)
        deadline = time.monotonic() + grace_s
        for p in group:
            if not _wait_gone(p["pid"], p["start"], deadline - time.monotonic()):
                _signal_recorded(p, signal.SIGKILL, grace_s)
    state_path.unlink(missing_ok=True)
    out("stopped")
    return 0


def _signal_recorded(p: dict, sig: int, grace_s: float) -> None:
    """Signal a recorded process: over ssh where it has a signal command (the local ssh client
    then ends with it), else directly, if that PID is still the process we started."""
    if p["signal_argv"]:
        name = signal.Signals(sig).name.removeprefix("SIG")
        try:
            subprocess.run([a.replace("{signal}", name) for a in p["signal_argv"]],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the host is out of reach; nothing more can be done from here
    elif p["start"] is not None and start_time(p["pid"]) == p["start"]:
        try:
            os.kill(p["pid"], sig)
        except ProcessLookupError:
            pass


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _launcher_alive(state: dict | None) -> bool:
    return state is not None and start_time(state["launcher_pid"]) == state["launcher_start"]


def _wait_gone(pid: int, start: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + max(0.0, timeout_s)
    while start is not None and start_time(pid) == start:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def default_state_dir(home: Path, topology_path: Path) -> Path:
    """Where a topology's logs and launch record go unless the file names a log_dir."""
    resolved = str(topology_path.resolve())
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:8]
    return home / "launch" / f"{topology_path.stem}-{digest}"
