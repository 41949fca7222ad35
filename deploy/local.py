"""Start a tandem topology on this host: a coordinator and its workers, one process each.

    topology = Topology(model="smollm2", model_path=path, prefill=1, decode=1)
    # several models: the same worker counts for each, one coordinator for all
    topology = Topology(model="smollm2", model_path=path, more_models=(("qwen3", path2),))
    # ... and counts of their own for some: qwen3 gets 2 prefill and 3 decode workers
    topology = Topology(..., model_workers=(("qwen3", 2, 3),))
    specs, ready = plan(topology)          # argv of every process, ports chosen here
    with LocalCluster(specs, ready) as cluster:
        cluster.start()                     # waits until the coordinator reports the workers
        cluster.wait()                      # until Ctrl-C / SIGTERM; restarts workers that exit

Start order: the coordinator first (workers register with it), then the workers. Ready means
the coordinator answers HTTP and GET /internal/workers lists the expected live workers by role.
If a process exits during start-up, the others are stopped and LaunchError names it with the
tail of its log. While serving, a worker that exits is logged with its log's tail and started
again after a backoff (1, 2, 4, ... 30 s; it re-registers by itself) while the rest serve on;
one that keeps dying right after each start is given up on, and then everything stops, as it
does when the coordinator exits. Only Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops a
healthy cluster; a second one kills every process at once. Stopping sends SIGTERM to the
workers, then the coordinator, within one `grace_s` for all, then SIGKILLs what is left, logs
how each ended and removes the shared-memory KV segments of its workers, whatever killed them.
Children run in their own sessions, so the terminal's signals reach only this launcher, which
forwards them in that order.

Children die with the launcher: each watches a lifeline pipe (common/lifeline.py) and stops
itself when the launcher is gone, SIGKILL and OOM kills included; a child that is not a tandem
process (the ssh client of a remote role) gets a parent-death signal instead. `serve` claims
the coordinator's ports first (deploy/ports.py): a second cluster on them fails at start.

Core lease: where prefill and decode workers both run (Topology.shares_cores, on unless
core_lease=False), `serve` makes the host's core lease (common/core_lease.py) before the
workers start, gives each worker its slot (--core-lease, --core-lease-slot), and removes it
after they have stopped; a decode worker then runs its native kernels on the cores of idle
prefill workers too (worker/core_share.py).

Logs: one file per process under `log_dir` (`coordinator.log`, `prefill-0.log`, ...).

Several models (`more_models`): one coordinator gets `--model` for each (the first is the
default), and each model gets its own workers, `prefill` and `decode` of them (or one colocated
worker), with the engine flags above; `model_workers` gives a model counts of its own
((name, prefill, decode), the name as in `models`; not with colocated). The first model's workers keep the names of a
single-model topology (`decode-0`); another model's carry its name before them
(`qwen3-decode-0`), so every worker id in the cluster is distinct. Ready means every worker,
by name, is live.

Engine flags, each to the processes that use it (None leaves that process's own default):
prefill_quant to prefill workers, decode_quant to decode workers (each packs only its own
format), both to a colocated worker; speculative to decode and colocated workers only; threads and num_blocks to every worker; kv_dtype to every
worker, always (prefill and decode must agree on it: one value for the whole topology);
device (and --no-cuda-graphs when cuda_graphs is False, --batch-invariant when batch_invariant
is True) to every worker, always;
chunk_size (the per-pass token budget) to every worker as --max-batched-tokens and to the
coordinator as --chunk-size (the largest chunk of its plan for a prefill worker); local_chunk_size
and max_streams to the coordinator, which sends the chunk plan with each request. worker_args
come after them on every worker's command line, so a flag there wins. api_key reaches the
coordinator alone, in its environment (TANDEM_API_KEY), never on a command line: ps shows those.

`tandem launch` (deploy/launch.py) reuses LocalCluster for other hosts: its specs wrap each
command in ssh or a command prefix, and a spec's `signal_argv` reaches a process that ssh
started on the far side.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DECODE_FORMATS, KV_DTYPES, PREFILL_FORMATS, CacheConfig
from engine.device import DEFAULT_DEVICE, check_device_spec
from engine.speculative_config import parse_speculative
from common.errors import TandemError
from common.model_name import name_key
from common.internal_http import get_internal
from common.lifeline import Lifeline, death_signal
from common.log_format import LOG_FORMATS
from common.tracing import protocol_from, traces_url
from common.core_lease import CoreLease, Slot as CoreSlot, lease_path, reclaim_stale as reclaim_stale_leases
from common.shm_segments import reclaim_orphans
from deploy.ports import claim_ports
from worker.config import DEFAULT_KV_BACKEND, DEFAULT_TOKEN_BUDGET, KV_BACKENDS
from worker.runtime import worker_env

WORKER_HOST = "127.0.0.1"


class LaunchError(TandemError):
    """A process of the topology failed to start, or the topology never became ready."""


@dataclass(frozen=True)
class Topology:
    model: str  # as the user named it; the coordinator resolves it and answers to it
    model_path: Path  # the resolved file or directory, given to the workers
    log_dir: Path
    host: str = "127.0.0.1"  # HTTP address of the coordinator
    port: int = 11434
    prefill: int = 1
    decode: int = 1
    colocated: bool = False  # one worker doing prefill and decode; prefill/decode ignored
    kv_backend: str = DEFAULT_KV_BACKEND
    chunk_size: int = DEFAULT_TOKEN_BUDGET  # per-pass token budget of every worker (--max-batched-tokens)
    prefill_threshold: int | None = None  # None = the coordinator's default
    # Engine flags (None = the process's own default); see the module docstring for who gets which.
    prefill_quant: str | None = None  # weight format of prefill workers (and colocated prompt passes)
    decode_quant: str | None = None  # weight format of decode workers (and colocated decode passes)
    threads: int | None = None  # threads per worker process (torch and native kernels)
    num_blocks: int | None = None  # KV pool size per worker, in blocks (else from --kv-cache-gb)
    kv_dtype: str = CacheConfig.kv_dtype  # KV cache element type of every worker (part of the KV layout)
    local_chunk_size: int | None = None  # largest prefill chunk of a prompt prefilled on a decode worker
    local_prefill_max_stall_ms: float | None = None  # None = the coordinator's default
    speculative: str | None = None  # --speculative of decode and colocated workers (None = off)
    device: str = DEFAULT_DEVICE  # every worker's --device (engine/device.py); each worker resolves it
    cuda_graphs: bool = True  # False: every worker gets --no-cuda-graphs
    # True: every worker gets --batch-invariant, and the coordinator --prefill-threshold 0
    batch_invariant: bool = False
    max_streams: int | None = None  # requests open at once on the coordinator (429 above)
    coordinator_args: tuple[str, ...] = ()  # more flags for `python -m coordinator`
    worker_args: tuple[str, ...] = ()  # more flags for every worker, after the ones above
    # The client APIs' key (coordinator/access.py); None = open. repr=False: kept out of logs.
    api_key: str | None = field(default=None, repr=False)
    # The internal plane (common/cluster_auth.py): the cluster secret reaches every process in
    # its environment (TANDEM_CLUSTER_SECRET), never on a command line; auth_args (e.g.
    # --tls-cert/--tls-key/--tls-ca, --cluster-secret-file: paths only) go to every process.
    # Both also pass through from this process's own environment, which children inherit.
    cluster_secret: str | None = field(default=None, repr=False)
    auth_args: tuple[str, ...] = ()
    # The client APIs' TLS (coordinator/api_tls.py): (cert, key) PEM paths, or None = plaintext.
    # The coordinator alone gets them, and the readiness poll then speaks https.
    api_tls: tuple[str, str] | None = None
    # More models served by the same cluster: (name as the user gave it, resolved path), each
    # with workers of its own (the module docstring). Empty: one model, `model`.
    more_models: tuple[tuple[str, Path], ...] = ()
    # (model name as in `models`, prefill, decode): that model's worker counts instead of
    # `prefill` and `decode` (tandem serve --workers MODEL=P:D). Disaggregated topologies only.
    # With load_on_request a name may also be a model the stores hold, not among `models`:
    # its workers are started with these counts when a request loads it (any spelling).
    model_workers: tuple[tuple[str, int, int], ...] = ()
    log_format: str = "text"  # every process's --log-format (common/log_format.py)
    access_log: bool = True  # False: the coordinator gets --no-access-log
    otlp_traces_endpoint: str | None = None  # every process's --otlp-traces-endpoint
    otlp_traces_protocol: str | None = None  # and --otlp-traces-protocol (None: the default)
    # A core lease for the workers of this host (common/core_lease.py): decode workers use
    # idle prefill workers' cores. Only where both roles run (shares_cores).
    core_lease: bool = True
    # A request may name a model the stores hold that is not among `models`: `serve` then
    # starts its workers on the coordinator's request (deploy/model_supervisor.py), with its
    # `model_workers` counts or those of `prefill`/`decode`/`colocated`, the engine flags
    # of all, and no core lease slot.
    load_on_request: bool = False

    @property
    def models(self) -> tuple[tuple[str, Path], ...]:
        """(name, path) of every model served, the default (`model`) first."""
        return ((self.model, self.model_path), *self.more_models)

    def counts(self, index: int) -> tuple[int, int]:
        """(prefill, decode) workers of the `index`-th model."""
        name = self.models[index][0]
        return next(((p, d) for n, p, d in self.model_workers if n == name),
                    (self.prefill, self.decode))

    def counts_for(self, model: str) -> tuple[int, int]:
        """(prefill, decode) workers of a model loaded on request: the `model_workers` counts
        of an entry that names it in any spelling (`qwen3` is `qwen3:latest`), else
        `prefill` and `decode`."""
        key = name_key(model)
        return next(((p, d) for n, p, d in self.model_workers if name_key(n) == key),
                    (self.prefill, self.decode))

    def worker_prefix(self, index: int) -> str:
        """What the names of the `index`-th model's workers start with ("" for the first)."""
        if index == 0:
            return ""
        slugs = [_slug(name) for name, _ in self.models]
        # A slug two models share gets the model's position too (plan() checks the result).
        return f"{slugs[index]}-" if slugs.count(slugs[index]) == 1 else f"{slugs[index]}-{index}-"

    def __post_init__(self) -> None:
        names = [n for n, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is named twice: {', '.join(names)}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"kv_backend must be one of {', '.join(KV_BACKENDS)}, "
                             f"got {self.kv_backend!r}")
        if self.model_workers and self.colocated:
            raise ValueError("worker counts per model are prefill:decode counts; a colocated "
                             "topology has one colocated worker per model")
        for name, _, _ in self.model_workers:
            if name not in names and not self.load_on_request:
                raise ValueError(f"worker counts are given for {name!r}, which is not a served "
                                 f"model (models: {', '.join(names)}); with load_on_request "
                                 "they may name a model a request loads")
        given = [name_key(n) if n not in names else n for n, _, _ in self.model_workers]
        if len(set(given)) != len(given):
            raise ValueError(f"worker counts are given twice for a model: {', '.join(given)}")
        if not self.colocated:
            on_request = [(n, p, d) for n, p, d in self.model_workers if n not in names]
            for name, prefill, decode in [(name, *self.counts(index))
                                          for index, (name, _) in enumerate(self.models)
                                          ] + on_request:
                of = f" of {name!r}" if self.model_workers else ""
                if decode < 1:
                    raise ValueError(f"a disaggregated topology needs at least one decode "
                                     f"worker{of}, got decode={decode}")
                if prefill < 0:
                    raise ValueError(f"prefill{of} must be >= 0, got {prefill}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.prefill_quant is not None and self.prefill_quant not in PREFILL_FORMATS:
            raise ValueError(f"prefill_quant must be one of {', '.join(PREFILL_FORMATS)} (prefill is "
                             f"compute-bound: GEMM formats), got {self.prefill_quant!r}")
        if self.decode_quant is not None and self.decode_quant not in DECODE_FORMATS:
            raise ValueError(f"decode_quant must be one of {', '.join(DECODE_FORMATS)} (decode is "
                             f"memory-bound: weight-only formats), got {self.decode_quant!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.batch_invariant and self.prefill_threshold:
            raise ValueError(f"prefill_threshold {self.prefill_threshold} prefills short prompts on "
                             "decode workers, in the decode format: with batch_invariant a "
                             "prompt's rows must run in one format wherever it is placed (give 0 "
                             "or leave it out)")
        check_device_spec(self.device)
        parse_speculative(self.speculative)  # ValueError naming what is wrong
        if self.otlp_traces_endpoint:
            traces_url(self.otlp_traces_endpoint)  # ValueError naming a bad URL
        if self.otlp_traces_protocol is not None:
            protocol_from(self.otlp_traces_protocol, {})  # ValueError naming a bad protocol
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, "
                             f"got {self.log_format!r}")
        if self.api_key is not None and not (self.api_key and all(
                "!" <= c <= "~" for c in self.api_key)):  # as coordinator/config.py checks it
            raise ValueError("the API key must be a non-empty string of visible ASCII "
                             "characters without spaces")
        for name in ("threads", "num_blocks", "local_chunk_size", "max_streams"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        stall = self.local_prefill_max_stall_ms
        if stall is not None and not (isinstance(stall, (int, float)) and stall >= 0):
            raise ValueError(f"local_prefill_max_stall_ms must be >= 0, got {stall!r}")
        if self.local_chunk_size is not None and self.local_chunk_size > self.chunk_size:
            raise ValueError(f"local_chunk_size ({self.local_chunk_size}) cannot exceed chunk_size "
                             f"({self.chunk_size}), the per-pass token budget of the decode worker "
                             f"it runs on")

    @property
    def shares_cores(self) -> bool:
        """Whether `serve` makes a core lease: asked for, and prefill and decode workers both."""
        return self.core_lease and not self.colocated and self.prefill > 0

    def worker_roles(self) -> list[tuple[int, Path, str, str]]:
        """(model index, model path, role, module) of every worker, in start order (also
        the order of the core lease's slots)."""
        def roles(index: int) -> list[tuple[str, str]]:
            if self.colocated:
                return [("colocated", "decode_node")]
            prefill, decode = self.counts(index)  # --workers MODEL=P:D, else --prefill/--decode
            return [("prefill", "prefill_node")] * prefill + [("decode", "decode_node")] * decode

        return [(i, path, role, module) for i, (_, path) in enumerate(self.models)
                for role, module in roles(i)]

    def core_slots(self) -> list[CoreSlot]:
        """The core lease's slots, one per worker in worker_roles' order."""
        return [CoreSlot(role, self.threads or 1) for _, _, role, _ in self.worker_roles()]

    def expected_workers(self) -> dict[str, int]:
        """Live workers by role, over every model."""
        n = len(self.models)
        if self.colocated:
            return {"colocated": n}
        counts = [self.counts(i) for i in range(n)]
        return {"prefill": sum(p for p, _ in counts), "decode": sum(d for _, d in counts)}

    def coordinator_flags(self) -> list[str]:
        flags = ["--chunk-size", str(self.chunk_size), *self.log_flags()]
        if not self.access_log:
            flags.append("--no-access-log")
        # Batch-invariant: every prompt goes to a prefill worker, whose format is the prompt's
        # wherever its prefix is cached (a short uncached part would run on the decode worker).
        threshold = 0 if self.batch_invariant and not self.colocated else self.prefill_threshold
        for flag, value in (("--prefill-threshold", threshold),
                            ("--local-chunk-size", self.local_chunk_size),
                            ("--local-prefill-max-stall-ms", self.local_prefill_max_stall_ms),
                            ("--max-streams", self.max_streams)):
            if value is not None:
                flags += [flag, str(value)]
        return flags

    def log_flags(self) -> list[str]:
        """Every process's --log-format and --otlp-traces-endpoint/-protocol, given only when
        not the processes' defaults (text, none, the OTEL_* variables' or http/protobuf)."""
        flags = [] if self.log_format == "text" else ["--log-format", self.log_format]
        if self.otlp_traces_endpoint:
            flags += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
        if self.otlp_traces_protocol:
            flags += ["--otlp-traces-protocol", self.otlp_traces_protocol]
        return flags

    def worker_flags(self, role: str) -> list[str]:
        """The engine flags a worker of `role` ("prefill", "decode", "colocated") uses."""
        flags = ["--max-batched-tokens", str(self.chunk_size), "--kv-dtype", self.kv_dtype,
                 *self.log_flags(), "--device", self.device]
        flags += ([] if self.cuda_graphs else ["--no-cuda-graphs"]) + (
            ["--batch-invariant"] if self.batch_invariant else [])
        # Speculation is decoding's: prefill workers never get --speculative.
        quants = {"prefill": [("--prefill-quant", self.prefill_quant)],
                  "decode": [("--decode-quant", self.decode_quant),
                             ("--speculative", self.speculative)],
                  "colocated": [("--prefill-quant", self.prefill_quant),
                                ("--decode-quant", self.decode_quant),
                                ("--speculative", self.speculative)]}[role]
        for flag, value in quants + [("--threads", self.threads), ("--num-blocks", self.num_blocks)]:
            if value is not None:
                flags += [flag, str(value)]
        return flags


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


def _slug(name: str) -> str:
    """A model's name as part of a worker id: `qwen3:0.6b` -> `qwen3-0-6b`."""
    return re.sub(r"[^a-z0-9]+", "-", Path(name).name.lower()).strip("-") or "model"


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


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen
    log: object = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    quick_failures: int = 0  # consecutive exits soon after a start
    restart_at: float | None = None  # set while a restart waits out its backoff
    # The model loaded on request this worker serves (deploy/model_supervisor.py), else None:
    # such a worker given up on stops only its model, never the cluster.
    model: str | None = None
    exits: list[tuple[int, str]] = field(default_factory=list)  # (code, log tail) while serving
    given_up: bool = False
    pids: list[int] = field(default_factory=list)  # every process started for it

    def __post_init__(self) -> None:
        self.pids.append(self.process.pid)


class LocalCluster:
    # Supervision while serving: a worker that exits is started again after a backoff (it
    # re-registers with the coordinator by itself), the coordinator and the other workers
    # serving on. A worker that keeps exiting within `quick_s` of its start more than
    # `max_quick_failures` times in a row is given up on, and then the cluster stops (it will
    # not come up: a wrong model, a refused layout). The coordinator exiting stops the cluster;
    # one of several coordinators (Readiness.more_urls) is restarted like a worker.
    def __init__(self, specs: list[ProcessSpec], ready: Readiness, *,
                 start_timeout_s: float = 300.0, grace_s: float = 10.0,
                 env: dict[str, str] | None = None,
                 restart_backoff_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0),
                 max_quick_failures: int = 5, quick_s: float = 10.0) -> None:
        self.restart_backoff_s = restart_backoff_s
        self.max_quick_failures = max_quick_failures
        self.quick_s = quick_s
        self.out: Callable[[str], None] = print
        self.specs = specs
        self.ready = ready
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        # One torch thread per process and passive OpenMP waits: several workers share a host.
        self.env = {**(worker_env() if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.children: list[_Child] = []
        # Held while the list changes or is walked: the supervisor channel's threads add and
        # remove the workers of models loaded on request while the main thread supervises.
        self.children_lock = threading.RLock()
        self.stop_requested = threading.Event()
        self.lifeline = Lifeline()  # the children's tie to this process
        self.pids: list[int] = []  # every process started, restarts included

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start every process and wait until the topology is ready (LaunchError if not)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start every process without waiting; `wait_ready` waits (the launcher records the
        processes in between, so that `tandem launch --down` can find them)."""
        for spec in self.specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab")
            self.children.append(_Child(spec, self._popen(spec, log), log))

    def respawn(self, name: str) -> subprocess.Popen:
        """Start the named process again with its own argv and log (it must have exited): the
        chaos suite's restart of a killed role, without the supervisor's backoff."""
        child = next(c for c in self.children if c.spec.name == name)
        if child.process.poll() is None:
            raise LaunchError(f"{name} is still running (pid {child.process.pid})")
        child.process = self._popen(child.spec, child.log)
        child.pids.append(child.process.pid)
        child.started, child.restart_at = time.monotonic(), None
        return child.process

    def _popen(self, spec: ProcessSpec, log) -> subprocess.Popen:
        # A tandem process watches the lifeline; an ssh client cannot, so it gets the death
        # signal, which is tied to the forking thread: only from the main thread.
        preexec = (death_signal() if spec.signal_argv
                   and threading.current_thread() is threading.main_thread() else None)
        process = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
                                   start_new_session=True,
                                   env={**self.env, **self.lifeline.child_env(), **dict(spec.env)},
                                   pass_fds=(*self.lifeline.pass_fds, *spec.pass_fds),
                                   preexec_fn=preexec)
        if spec.stdin:  # a few bytes: the pipe's buffer holds them, nothing blocks
            try:
                process.stdin.write(spec.stdin)
                process.stdin.close()
            except BrokenPipeError:
                pass  # it exited at once; the supervisor reports it
        self.pids.append(process.pid)
        return process

    def wait_ready(self) -> None:
        """Wait until the coordinator reports the expected workers; on failure or interrupt,
        stop every process and raise LaunchError."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while True:
            self._check_children("during start-up")
            if self.stop_requested.is_set():
                raise LaunchError("start-up interrupted")
            live = self._live_workers()
            if isinstance(live, tuple):
                counts, ids = live
                missing = [w for w in self.ready.worker_ids if w not in ids]
                if not missing and all(counts.get(role, 0) >= n
                                       for role, n in self.ready.expected.items()):
                    return
                last = f"live workers {counts}, expected {self.ready.expected}" + (
                    f", not yet registered: {', '.join(missing)}" if missing else "")
            else:
                last = live
            if time.monotonic() > deadline:
                raise LaunchError(f"the topology was not ready within {self.start_timeout_s:g} s "
                                  f"({last}); logs are in {self.specs[0].log_path.parent}")
            self.stop_requested.wait(0.25)

    def _live_workers(self) -> tuple[dict[str, int], set[str]] | str:
        """(live counts by role, ids of live workers) that every coordinator reports (the
        least of each count, the ids all list), or why one did not say."""
        counts: dict[str, int] | None = None
        ids: set[str] | None = None
        for url in self.ready.urls:
            try:
                # Over https get_internal does not check the certificate: it is made for the
                # names clients use, maybe not for this address, and the answer is only a
                # count of live workers, from a process this launcher started.
                report = get_internal(url, self.ready.secret, timeout=2)
                live = {w["worker_id"] for w in report["workers"] if w["alive"]}
                counts = report["live"] if counts is None else {
                    role: min(n, report["live"].get(role, 0)) for role, n in counts.items()}
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
                return f"coordinator{'' if len(self.ready.urls) == 1 else ' ' + url} not answering: {exc}"
            ids = live if ids is None else ids & live
        return counts, ids

    def _check_children(self, when: str) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise LaunchError(f"{child.spec.name} exited with code {code} {when}; last lines "
                                  f"of {child.spec.log_path}:\n{log_tail(child.spec.log_path)}")

    def wait(self, poll_s: float = 0.5) -> str | None:
        """Serve until stop is requested (None), restarting workers that exit; or until the
        coordinator exits or a worker is given up on (why, as text)."""
        while not self.stop_requested.wait(poll_s):
            failure = self._supervise()
            if failure is not None:
                return failure
        return None

    def _supervise(self) -> str | None:
        with self.children_lock:
            return self._supervise_locked()

    def _supervise_locked(self) -> str | None:
        now = time.monotonic()
        for i, child in enumerate(self.children):
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.process = self._popen(child.spec, child.log)
                    child.pids.append(child.process.pid)
                    child.started, child.restart_at = now, None
                    self.out(f"restarted {child.spec.name} (pid {child.process.pid})")
                continue
            code = child.process.poll()
            if code is None or child.given_up:
                continue
            tail = log_tail(child.spec.log_path)
            why = (f"{child.spec.name} exited with code {code} while serving; last lines of "
                   f"{child.spec.log_path}:\n{tail}")
            if i == 0 and len(self.ready.urls) == 1:  # the workers cannot serve without it
                return why
            if child.model is not None:
                child.exits.append((code, tail))  # the coordinator asks (a failed load)
            # A worker, or one of several coordinators (the others serve on; the workers
            # register with it again by themselves): restarted after a backoff.
            child.quick_failures = child.quick_failures + 1 if now - child.started < self.quick_s else 1
            if child.quick_failures > self.max_quick_failures:
                gave_up = (f"{why}\n{child.spec.name} exited within {self.quick_s:g} s of "
                           f"starting {child.quick_failures} times in a row; not restarting it")
                if child.model is None:
                    return gave_up
                child.given_up = True  # its model alone is lost; its coordinator unloads it
                self.out(gave_up)
                continue
            delay = self.restart_backoff_s[min(child.quick_failures, len(self.restart_backoff_s)) - 1]
            child.restart_at = now + delay
            self.out(f"{why}\nrestarting {child.spec.name} in {delay:g} s")
        return None

    def stop(self) -> None:
        """Workers first (so none re-registers with a vanishing coordinator), coordinator last,
        all within one grace period; then SIGKILL. Logs how each ended; removes the workers'
        shared-memory segments that are left."""
        with self.children_lock:
            children = list(self.children)
        deadline = time.monotonic() + self.grace_s
        ended = []
        # The coordinator gets a second at least, even after slow workers.
        n = len(self.ready.urls)
        for floor_s, group in ((0.0, children[n:]), (1.0, children[:n])):
            ended += self._end(group, deadline, floor_s)
        for child in children:
            child.log.close()
        removed = reclaim_orphans(owners=self.pids)
        if ended or removed:
            self.out(f"stopped {', '.join(ended) or 'nothing (every process had exited)'}"
                     + (f"; removed shared memory {', '.join(removed)}" if removed else ""))

    def _end(self, group: list[_Child], deadline: float, floor_s: float = 0.0) -> list[str]:
        """SIGTERM to the running processes of `group`, SIGKILL to those still there at
        `deadline`; how each ended."""
        ended = []
        running = [c for c in group if c.process.poll() is None]
        for child in running:
            self._signal(child, signal.SIGTERM)
        for child in running:
            try:
                child.process.wait(max(floor_s, deadline - time.monotonic()))
                how = f"exit {child.process.returncode}"
            except subprocess.TimeoutExpired:
                self._signal(child, signal.SIGKILL)
                _signal(child.process, signal.SIGKILL)
                how = f"SIGKILL after {self.grace_s:g} s"
                try:
                    child.process.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    how += ", still not gone"
            ended.append(f"{child.spec.name} (pid {child.process.pid}, {how})")
        return ended

    # ---- the workers of models loaded on request (deploy/model_supervisor.py) -------------------

    def add_model(self, model: str, specs: list[ProcessSpec]) -> None:
        """Start a model's workers while serving; supervised as the others, except that one
        given up on stops only its model."""
        with self.children_lock:
            if self.stop_requested.is_set():
                raise LaunchError("the cluster is stopping")
            for spec in specs:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(spec.log_path, "ab")
                self.children.append(_Child(spec, self._popen(spec, log), log, model=model))

    def model_children(self, model: str) -> list[_Child]:
        with self.children_lock:
            return [c for c in self.children if c.model == model]

    def remove_model(self, model: str) -> tuple[list[str], list[str]]:
        """Stop a model's workers (SIGTERM, SIGKILL after grace_s) and forget them; (how each
        ended, the shared-memory KV segments of theirs removed)."""
        with self.children_lock:
            group = [c for c in self.children if c.model == model]
            self.children = [c for c in self.children if c.model != model]
        ended = self._end(group, time.monotonic() + self.grace_s)
        for child in group:
            child.log.close()
        # Every pid of theirs, restarts included: the segments a killed worker left behind.
        return ended, reclaim_orphans(owners=[pid for c in group for pid in c.pids])

    def kill_now(self) -> None:
        """SIGKILL every process at once (a second Ctrl-C); stop() then reaps them."""
        for child in self.children:
            if child.process.poll() is None:
                self._signal(child, signal.SIGKILL)
                _signal(child.process, signal.SIGKILL)

    def _signal(self, child: _Child, sig: int) -> None:
        if not child.spec.signal_argv:
            _signal(child.process, sig)
            return
        name = signal.Signals(sig).name.removeprefix("SIG")
        argv = [a.replace("{signal}", name) for a in child.spec.signal_argv]
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=self.grace_s, env=self.env)
        except (OSError, subprocess.TimeoutExpired):
            # The remote side is out of reach; ending the local end (ssh) is all that is left.
            _signal(child.process, sig)


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass


def serve(topology: Topology, *, start_timeout_s: float = 300.0,
          out: Callable[[str], None] = print, lock_dir: Path | None = None,
          more_ports: tuple[int, ...] = (), supervisor_factory=None) -> int:
    """Run a topology until Ctrl-C, SIGTERM or SIGHUP; 0 on a requested stop, 1 if a process
    failed. First claims the HTTP port and `more_ports` (the coordinator's other listening
    ports on its host; locks in `lock_dir`): PortInUse if one is held, nothing started.
    supervisor_factory(topology, registry_port): the coordinator's supervisor channel
    (deploy/model_supervisor.ModelSupervisor, for topology.load_on_request)."""
    with claim_ports(lock_dir, (topology.port, *more_ports), topology.host):
        lease = make_core_lease(topology, out)
        try:
            return _serve(topology, start_timeout_s, out, lease, supervisor_factory)
        finally:  # every worker has stopped by now (run_until_stopped)
            if lease is not None:
                lease.unlink()


def make_core_lease(topology: Topology, out: Callable[[str], None] = print) -> CoreLease | None:
    """The host's core lease for the topology's workers (None where it shares no cores),
    after reclaiming the leases of launchers that are gone."""
    if not topology.shares_cores:
        return None
    stale = reclaim_stale_leases()
    if stale:
        out(f"removed the core leases of gone launchers: {', '.join(stale)}")
    return CoreLease.create(lease_path(str(topology.port)), topology.core_slots(), loading_pid=os.getpid())


def _serve(topology: Topology, start_timeout_s: float, out: Callable[[str], None],
           lease: CoreLease | None = None, supervisor_factory=None) -> int:
    specs, ready = plan(topology, core_lease=lease.path if lease else None)
    supervisor = None
    if supervisor_factory is not None:
        supervisor = supervisor_factory(topology, registry_port_of(specs[0]))
        specs[0] = supervisor.attach(specs[0])
    # OpenMP reads its thread count when torch starts, before a worker's own --threads.
    cluster = LocalCluster(specs, ready, start_timeout_s=start_timeout_s,
                           env=worker_env(topology.threads or 1))
    if supervisor is not None:
        supervisor.cluster = cluster

    def on_ready() -> None:
        out(f"tandem is serving {', '.join(n for n, _ in topology.models)} at {ready.url}  (Ollama API: "
            f"{ready.url}/api/chat, metrics: {ready.url}/metrics); Ctrl-C stops it")
        for spec in specs[1:]:
            out(f"  {spec.name}: {' '.join(spec.argv[2:])}")

    out(f"starting {', '.join(s.name for s in specs)}; logs in {topology.log_dir}")
    try:
        return run_until_stopped(cluster, on_ready, out, on_spawn=supervisor.serve_in_background
                                 if supervisor is not None else None)
    finally:
        if supervisor is not None:
            supervisor.close()


def run_until_stopped(cluster: LocalCluster, on_ready: Callable[[], None],
                      out: Callable[[str], None] = print,
                      on_spawn: Callable[[], None] | None = None) -> int:
    """Start `cluster`, call on_ready, serve until SIGINT/SIGTERM/SIGHUP (0) or until a process
    exits (1); 130 when interrupted during start-up. Every process is stopped on the way out;
    a second signal kills them at once. on_spawn runs once every process has been started,
    before waiting for readiness."""
    cluster.out = out

    def on_signal(sig: int, _frame) -> None:
        name = signal.Signals(sig).name
        if cluster.stop_requested.is_set():
            out(f"{name} again: killing every process now")
            cluster.kill_now()
        else:
            out(f"{name}: stopping every process (send it again to kill them at once)")
            cluster.stop_requested.set()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        with cluster:
            try:
                cluster.spawn()
                if on_spawn is not None:
                    on_spawn()
                cluster.wait_ready()
            except LaunchError:
                if cluster.stop_requested.is_set():
                    out("interrupted during start-up; stopped every process")
                    return 130
                raise
            on_ready()
            failure = cluster.wait()
            if failure:
                out(f"stopping: {failure}")
                return 1
            out("stopping")
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
