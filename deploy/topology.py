"""A multi-host topology file (TOML): which roles run on which hosts, on which ports.

    model = "smollm2"            # a name in each host's own store (`tandem pull`), or a path;
                                 # a list serves several: ["smollm2", "qwen3:0.6b"] (the first
                                 # is the default), each worker naming its own (below)
    kv_backend = "zmq"           # zmq | grpc across hosts; shm only when all workers share one
    worker_args = ["--decode-quant", "int4"]   # optional: flags for every worker

    [hosts.gpu-a]                # how to reach a host; a role's host missing here is taken
    address = "10.0.0.1"         #   as an address: loopback -> local, anything else -> ssh
    ssh = "ubuntu@10.0.0.1"      # start processes over SSH ...
    # exec = ["ip", "netns", "exec", "n1"]   # ... or through a command prefix that execs
    python = "/opt/tandem/.venv/bin/python"
    env = { TANDEM_HOME = "/data/tandem" }

    [coordinator]
    host = "gpu-a"
    port = 11434                 # HTTP (Ollama API)
    registry_port = 50050        # gRPC Registry, where workers register
    grpc_port = 50051            # optional: client gRPC API with the health service
    # Or several coordinators, [[coordinator]] tables (named coordinator-0, -1, ...): every
    # worker registers with each, each serves requests on its own, and clients hold the list
    # of their URLs (or a TCP load balancer in front): one killed, the others serve on.

    [[prefill]]
    host = "gpu-a"
    port = 50061

    [[decode]]
    host = "gpu-b"
    port = 50071
    kv_port = 50081              # the KV receiver (0 or absent: any free port)
    # model = "qwen3:0.6b"       # which of the models this worker serves (default: the first);
                                 # each model needs a [[decode]] or [[colocated]] worker

    [security]                   # optional: the authenticated internal plane (common/cluster_auth.py)
    cluster_secret_file = "/etc/tandem/secret"   # paths as every host sees them
    tls_cert = "/etc/tandem/node.pem"            # mutual TLS: all three, or none
    tls_key = "/etc/tandem/node.key"
    tls_ca = "/etc/tandem/ca.pem"
    # tls_server_name = "tandem.internal"        # one cluster certificate for every host
    # insecure_internal_plane = true             # off loopback: allow an open plane (no secret)

Without cluster_secret_file, `tandem launch` hands every process a secret in its environment
($TANDEM_CLUSTER_SECRET, else one it makes; deploy/cluster_secret.py). A topology whose roles
listen off loopback is refused without a secret unless insecure_internal_plane is set (or
`tandem launch --insecure-internal-plane`); without tls_* files it also gets mutual TLS from a
CA the launch makes (deploy/plane_security.py, deploy/cluster_ca.py).

Every mistake that can be seen in the file alone raises TopologyError here, naming the key:
unknown roles and settings, missing or clashing ports, a role on an undeclared host that is
not an address, shm across hosts, workers whose flags give different KV layouts.
Reachability, the model and free ports on each host are checked by
`deploy.launch.preflight` before anything starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from common.addresses import is_loopback
from common.errors import TandemError
from engine.config import CacheConfig
from worker.config import DEFAULT_KV_BACKEND, DEFAULT_TOKEN_BUDGET

WORKER_ROLES = ("prefill", "decode", "colocated")
ROLES = ("coordinator", *WORKER_ROLES)
KV_BACKENDS = ("zmq", "grpc", "shm")
DEFAULT_BLOCK_SIZE = CacheConfig.block_size  # a worker's --block-size default

_TOP_KEYS = {"model", "kv_backend", "chunk_size", "prefill_threshold", "log_dir", "worker_args",
             "coordinator_args", "hosts", "start_timeout_s", "security"}
_SECURITY_PATHS = {"cluster_secret_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name"}
_SECURITY_KEYS = _SECURITY_PATHS | {"insecure_internal_plane"}
_HOST_KEYS = {"address", "bind", "ssh", "ssh_options", "exec", "python", "env", "workdir"}
_COORDINATOR_KEYS = {"host", "port", "registry_port", "grpc_port", "args"}
_WORKER_KEYS = {"host", "port", "kv_port", "name", "args", "model"}


class TopologyError(TandemError):
    """The topology file is wrong, or a host cannot run what it names."""


@dataclass(frozen=True)
class Host:
    name: str  # the key under [hosts], or the address itself
    address: str  # how the other roles (and the launcher) reach processes here
    bind: str  # what processes here listen on
    ssh: str | None = None  # ssh destination: processes start over SSH
    ssh_options: tuple[str, ...] = ()  # more ssh flags, e.g. ("-p", "2222")
    exec_prefix: tuple[str, ...] = ()  # a command prefix that execs its arguments elsewhere
    python: str | None = None  # interpreter there; None = this one (local) or python3 (ssh)
    env: tuple[tuple[str, str], ...] = ()  # environment of processes there
    workdir: str | None = None

    @property
    def kind(self) -> str:
        return "ssh" if self.ssh else "exec" if self.exec_prefix else "local"

    def describe(self) -> str:
        how = {"ssh": f"ssh {self.ssh}", "exec": " ".join(self.exec_prefix),
               "local": "this machine"}[self.kind]
        return f"host {self.name!r} ({self.address}, via {how})"


@dataclass(frozen=True)
class Role:
    name: str  # "coordinator", "prefill-0", ... (the worker id)
    role: str  # one of ROLES
    host: Host
    port: int  # HTTP port for the coordinator, gRPC port for workers
    registry_port: int = 0  # coordinator only
    grpc_port: int = 0  # coordinator only: client gRPC API; 0 = the coordinator's default
    kv_port: int = 0  # decode/colocated only; 0 = any free port
    args: tuple[str, ...] = ()  # more flags for this process
    model: str = ""  # workers: the model this one serves (one of the topology's); "" for the coordinator

    def ports(self) -> list[tuple[str, int]]:
        """(what, port) of every fixed port this role listens on."""
        named = [("port", self.port), ("registry_port", self.registry_port),
                 ("grpc_port", self.grpc_port), ("kv_port", self.kv_port)]
        return [(what, p) for what, p in named if p]


@dataclass(frozen=True)
class ClusterTopology:
    source: Path  # the file, for messages and the launch's state folder
    model: str  # the default model (the first of `model`'s list)
    kv_backend: str
    coordinators: tuple[Role, ...]  # one or more, each serving on its own
    workers: tuple[Role, ...]
    more_models: tuple[str, ...] = ()  # the rest of `model`'s list: served too
    chunk_size: int = DEFAULT_TOKEN_BUDGET
    prefill_threshold: int | None = None
    log_dir: Path | None = None
    start_timeout_s: float = 300.0
    worker_args: tuple[str, ...] = ()
    coordinator_args: tuple[str, ...] = ()
    # Flags of [security] for every process (paths only: the secret itself never travels
    # on a command line); see common/cluster_auth.py.
    auth_args: tuple[str, ...] = ()
    # [security] insecure_internal_plane: the operator allows an open plane off loopback.
    insecure_internal_plane: bool = False
    hosts: tuple[Host, ...] = field(default=(), repr=False)  # every host a role runs on

    @property
    def models(self) -> tuple[str, ...]:
        """Every model served, the default first."""
        return (self.model, *self.more_models)

    def models_on(self, host: Host) -> tuple[str, ...]:
        """The models the roles on `host` need: all of them for a coordinator (it reads
        every model's tokenizer), each worker's own."""
        if any(host.name == c.host.name for c in self.coordinators):
            return self.models
        return tuple(m for m in self.models
                     if any(w.model == m and w.host.name == host.name for w in self.workers))

    @property
    def coordinator(self) -> Role:
        """The first coordinator: the one the launcher polls and prints first."""
        return self.coordinators[0]

    @property
    def roles(self) -> tuple[Role, ...]:
        """Every role, coordinators first."""
        return (*self.coordinators, *self.workers)

    @property
    def secret_file(self) -> str | None:
        """[security] cluster_secret_file (each host reads its own copy), or None."""
        args = self.auth_args
        return args[args.index("--cluster-secret-file") + 1] if "--cluster-secret-file" in args else None

    @property
    def off_loopback(self) -> bool:
        """Whether some role listens on an address other hosts may reach."""
        return any(not is_loopback(r.host.bind) for r in self.roles)

    @property
    def registry_address(self) -> str:
        """What a worker's --coordinator takes: every coordinator's registry, comma-separated."""
        return ",".join(f"{c.host.address}:{c.registry_port}" for c in self.coordinators)

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> tuple[str, ...]:
        """Every coordinator's HTTP base URL: the client-side list."""
        return tuple(f"http://{_url_host(c.host.address)}:{c.port}" for c in self.coordinators)

    def expected_workers(self) -> dict[str, int]:
        counts = dict.fromkeys(WORKER_ROLES, 0)
        for w in self.workers:
            counts[w.role] += 1
        return {role: n for role, n in counts.items() if n}


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def load_topology(path: str | Path) -> ClusterTopology:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise TopologyError(f"cannot read topology {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: not valid TOML: {exc}") from None
    return parse_topology(data, path)


def parse_topology(data: dict, source: Path) -> ClusterTopology:
    where = str(source)
    for key, value in data.items():
        if key in _TOP_KEYS or key in ROLES:
            continue
        if isinstance(value, (dict, list)):
            raise TopologyError(f"{where}: unknown role [{key}]; roles are "
                                f"{', '.join(ROLES)}")
        raise TopologyError(f"{where}: unknown setting {key!r}; settings are "
                            f"{', '.join(sorted(_TOP_KEYS - {'hosts'}))}")
    models = _models(data, where)
    kv_backend = _string(data, "kv_backend", where) or DEFAULT_KV_BACKEND
    if kv_backend not in KV_BACKENDS:
        raise TopologyError(f"{where}: kv_backend must be one of {', '.join(KV_BACKENDS)}, "
                            f"got {kv_backend!r}")
    hosts = _parse_hosts(data.get("hosts", {}), where)
    used: dict[str, Host] = {}

    def host_of(table: dict, at: str) -> Host:
        name = _string(table, "host", at, required=True)
        host = hosts.get(name) or _implicit_host(name, at)
        used[host.name] = host
        return host

    coordinator_tables = data.get("coordinator")
    if isinstance(coordinator_tables, dict):
        coordinator_tables = [coordinator_tables]
    if (not isinstance(coordinator_tables, list) or not coordinator_tables
            or not all(isinstance(t, dict) for t in coordinator_tables)):
        raise TopologyError(f"{where}: missing [coordinator] (a table with host, port, "
                            "registry_port; or [[coordinator]] tables, one per coordinator)")
    coordinators = []
    for index, table in enumerate(coordinator_tables):
        several = len(coordinator_tables) > 1
        at = f"{where} [[coordinator]] #{index + 1}" if several else f"{where} [coordinator]"
        _check_keys(table, _COORDINATOR_KEYS, at)
        coordinators.append(Role(f"coordinator-{index}" if several else "coordinator",
                                 "coordinator", host_of(table, at),
                                 port=_port(table, "port", at, default=11434),
                                 registry_port=_port(table, "registry_port", at, default=50050),
                                 grpc_port=_port(table, "grpc_port", at, default=0),
                                 args=_strings(table, "args", at)))
    workers = []
    for role in WORKER_ROLES:
        tables = data.get(role, [])
        if isinstance(tables, dict):
            tables = [tables]
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise TopologyError(f"{where}: [[{role}]] must be tables, one per worker")
        for index, table in enumerate(tables):
            at = f"{where} [[{role}]] #{index + 1}"
            _check_keys(table, _WORKER_KEYS, at)
            if "kv_port" in table and role == "prefill":
                raise TopologyError(f"{at}: kv_port belongs to decode workers (prefill workers "
                                    "only send KV)")
            model = _string(table, "model", at) or models[0]
            if model not in models:
                raise TopologyError(f"{at}: model {model!r} is not one of the topology's "
                                    f"models ({', '.join(models)})")
            workers.append(Role(_string(table, "name", at) or f"{role}-{index}", role,
                                host_of(table, at), port=_port(table, "port", at, required=True),
                                kv_port=_port(table, "kv_port", at, default=0),
                                args=_strings(table, "args", at), model=model))
    topology = ClusterTopology(
        source=source, model=models[0], more_models=models[1:], kv_backend=kv_backend,
        coordinators=tuple(coordinators),
        workers=tuple(workers), chunk_size=_int(data, "chunk_size", where, DEFAULT_TOKEN_BUDGET, minimum=1),
        prefill_threshold=(_int(data, "prefill_threshold", where, 0, minimum=0)
                           if "prefill_threshold" in data else None),
        log_dir=Path(data["log_dir"]).expanduser() if _string(data, "log_dir", where) else None,
        start_timeout_s=float(_int(data, "start_timeout_s", where, 300, minimum=1)),
        worker_args=_strings(data, "worker_args", where),
        coordinator_args=_strings(data, "coordinator_args", where),
        auth_args=_security_args(data.get("security", {}), f"{where} [security]", source),
        insecure_internal_plane=_bool(data.get("security", {}), "insecure_internal_plane",
                                      f"{where} [security]"),
        hosts=tuple(used.values()))
    _check_workers(topology, where)
    return topology


def _models(data: dict, where: str) -> tuple[str, ...]:
    """`model`: one name or path, or a list of distinct ones (the first is the default)."""
    value = data.get("model")
    if isinstance(value, list):
        if not value or not all(isinstance(m, str) and m for m in value):
            raise TopologyError(f"{where}: model must be a name or a non-empty list of names, "
                                f"got {value!r}")
        if len(set(value)) != len(value):
            raise TopologyError(f"{where}: a model is listed twice in model: {', '.join(value)}")
        return tuple(value)
    return (_string(data, "model", where, required=True),)


def _security_args(table: object, at: str, source: Path) -> tuple[str, ...]:
    """[security] as flags; relative paths are taken from the topology file's folder."""
    if not isinstance(table, dict):
        raise TopologyError(f"{at} must be a table")
    _check_keys(table, _SECURITY_KEYS, at)
    tls = [k for k in ("tls_cert", "tls_key", "tls_ca") if k in table]
    if tls and len(tls) != 3:
        raise TopologyError(f"{at}: mutual TLS needs tls_cert, tls_key and tls_ca together")
    flags: list[str] = []
    for key in sorted(_SECURITY_PATHS):
        value = _string(table, key, at)
        if value:
            if key != "tls_server_name" and not Path(value).expanduser().is_absolute():
                value = str((source.parent / value).resolve())
            elif key != "tls_server_name":
                value = str(Path(value).expanduser())
            flags += [f"--{key.replace('_', '-')}", value]
    return tuple(flags)


def _check_workers(t: ClusterTopology, where: str) -> None:
    if not any(w.role in ("decode", "colocated") for w in t.workers):
        raise TopologyError(f"{where}: no [[decode]] or [[colocated]] worker: nothing could "
                            "generate tokens")
    for model in t.more_models and t.models:
        if not any(w.role in ("decode", "colocated") and w.model == model for w in t.workers):
            raise TopologyError(f"{where}: model {model!r} has no [[decode]] or [[colocated]] "
                                "worker (a worker names its model with model = ...)")
    names: dict[str, Role] = {}
    for w in t.workers:
        if w.name in names:
            raise TopologyError(f"{where}: two roles are named {w.name!r}")
        if w.name.startswith("coordinator"):  # coordinator, coordinator-N: their logs, records
            raise TopologyError(f"{where}: worker name {w.name!r}: names starting with "
                                "'coordinator' are the coordinators'")
        names[w.name] = w
    taken: dict[tuple[str, int], str] = {}
    for role in t.roles:
        for what, port in role.ports():
            key = (role.host.address, port)
            if key in taken:
                raise TopologyError(
                    f"{where}: duplicate port {port} on host {role.host.name!r}: "
                    f"{role.name} {what} and {taken[key]}")
            taken[key] = f"{role.name} {what}"
    loopback = {r.host.name for r in t.roles if is_loopback(r.host.address)}
    if loopback and len(loopback) < len({r.host.name for r in t.roles}):
        raise TopologyError(f"{where}: hosts {', '.join(sorted(loopback))} have loopback "
                            "addresses, which roles on the other hosts cannot reach; give "
                            "every host an address the others can reach")
    if t.kv_backend == "shm":
        worker_hosts = {w.host.address for w in t.workers}
        if len(worker_hosts) > 1:
            raise TopologyError(f"{where}: kv_backend 'shm' needs every worker on one host, "
                                f"but they are on {', '.join(sorted(worker_hosts))}; use zmq "
                                "or grpc across hosts")
    # The KV layout a worker advertises follows the model and its --block-size; workers that
    # disagree could never pair, so say so now rather than at the first request.
    sizes = {w.name: _block_size(t.worker_args + w.args) for w in t.workers}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{n}={s}" for n, s in sizes.items())
        raise TopologyError(f"{where}: workers have different --block-size ({listed}), so "
                            "their KV layouts differ and prefill could not pair with decode")


def _block_size(args: tuple[str, ...]) -> str:
    size = str(DEFAULT_BLOCK_SIZE)
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args):
            size = args[i + 1]
        elif arg.startswith("--block-size="):
            size = arg.split("=", 1)[1]
    return size


def _parse_hosts(table: object, where: str) -> dict[str, Host]:
    if not isinstance(table, dict):
        raise TopologyError(f"{where}: [hosts] must be a table of hosts")
    hosts = {}
    for name, spec in table.items():
        at = f"{where} [hosts.{name}]"
        if not isinstance(spec, dict):
            raise TopologyError(f"{at}: must be a table")
        _check_keys(spec, _HOST_KEYS, at)
        address = _string(spec, "address", at) or name
        ssh = _string(spec, "ssh", at)
        exec_prefix = _strings(spec, "exec", at)
        if ssh and exec_prefix:
            raise TopologyError(f"{at}: give ssh or exec, not both")
        env = spec.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise TopologyError(f"{at}: env must be a table of strings")
        hosts[name] = Host(name=name, address=address,
                           bind=_string(spec, "bind", at) or _default_bind(address),
                           ssh=ssh, ssh_options=_strings(spec, "ssh_options", at),
                           exec_prefix=exec_prefix, python=_string(spec, "python", at),
                           env=tuple(sorted(env.items())), workdir=_string(spec, "workdir", at))
    return hosts


def _implicit_host(name: str, at: str) -> Host:
    if is_loopback(name):
        return Host(name=name, address=name, bind=name)
    if name.replace("-", "").replace(".", "").isalnum() or ":" in name:
        return Host(name=name, address=name, bind="0.0.0.0", ssh=name)
    raise TopologyError(f"{at}: host {name!r} is neither declared under [hosts] nor an address")


def _default_bind(address: str) -> str:
    return address if is_loopback(address) else "0.0.0.0"


def _check_keys(table: dict, allowed: set[str], at: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise TopologyError(f"{at}: unknown key {unknown[0]!r}; allowed: "
                            f"{', '.join(sorted(allowed))}")


def _string(table: dict, key: str, at: str, required: bool = False) -> str | None:
    value = table.get(key)
    if value is None:
        if required:
            raise TopologyError(f"{at}: missing {key!r}")
        return None
    if not isinstance(value, str) or not value:
        raise TopologyError(f"{at}: {key} must be a non-empty string, got {value!r}")
    return value


def _bool(table: dict, key: str, at: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise TopologyError(f"{at}: {key} must be true or false, got {value!r}")
    return value


def _strings(table: dict, key: str, at: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TopologyError(f"{at}: {key} must be a list of strings, got {value!r}")
    return tuple(value)


def _int(table: dict, key: str, at: str, default: int, minimum: int) -> int:
    value = table.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TopologyError(f"{at}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def _port(table: dict, key: str, at: str, default: int | None = None,
          required: bool = False) -> int:
    if key not in table:
        if required:
            raise TopologyError(f"{at}: missing {key!r}")
        return default or 0
    value = table[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise TopologyError(f"{at}: {key} must be a port in 1..65535, got {value!r}")
    return value
