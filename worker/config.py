"""A worker process's configuration: built once from its flags (worker/flags.py) by
WorkerConfig.from_args, validated at construction, never changed after.

    WorkerConfig          the process: addresses, role, KV transport, threads, auth
      engine: EngineConfig  the engine it runs (engine/config.py); model None until the
                            model's files are read, cache.num_blocks None until sized

Torch-free: the CLI and the launchers import the defaults below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.addresses import is_loopback
from engine.config import ENGINE_ROLES, CacheConfig, EngineConfig, SchedulerConfig

if TYPE_CHECKING:
    import argparse

    from common.cluster_auth import ClusterAuth

# kvtransfer.backends() less "fake", spelled out so that the flags stay torch-free
# (tests/kvtransfer/test_kvtransfer_dist.py checks that the two agree).
KV_BACKENDS = ("zmq", "shm", "grpc", "dist")
DEFAULT_KV_BACKEND = "zmq"
# Decode: the fastest format that keeps answers right on the default model (README: quality
# table). Prefill: fp32 where it fits easily, else bf16, else w8a8.
DEFAULT_PREFILL_QUANT = "auto"  # by the model's size and the host's memory (engine/format_choice.py)
DEFAULT_DECODE_QUANT = "int4"
# Every worker's per-pass token budget unless told (`tandem serve --chunk-size`).
DEFAULT_TOKEN_BUDGET = SchedulerConfig.max_num_batched_tokens


def coordinator_list(text: str | None) -> tuple[str, ...]:
    """`--coordinator A,B` as its registries, in order: each HOST:PORT (an IPv6 host in
    brackets), none twice. ValueError naming the entry that is not one."""
    if not text:
        return ()
    entries = tuple(part.strip() for part in text.split(","))
    for entry in entries:
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator takes HOST:PORT[,HOST:PORT...], got {entry!r} "
                             f"in {text!r}")
    if len(set(entries)) != len(entries):
        raise ValueError(f"--coordinator names a registry twice: {text!r}")
    return entries


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # name in the store, GGUF file or Hugging Face directory
    port: int  # of this worker's gRPC server
    role: str  # one of ENGINE_ROLES the node serves
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # the gRPC server's bind address
    advertise_host: str | None = None  # how the coordinator and peers reach us (else host)
    # HOST:PORT of the registry, or several, comma-separated (coordinator_list): the worker
    # registers with each on its own; None runs alone.
    coordinator: str | None = None
    coordinator_retry_s: float = 300.0  # unreachable this long: exit (0 = retry forever)
    worker_id: str | None = None  # None: role plus a random suffix
    kv_backend: str = DEFAULT_KV_BACKEND  # one of KV_BACKENDS
    kv_port: int = 0  # decode: the KV receiver's port (0 = any)
    kv_advertise: str | None = None  # decode: the KV endpoint peers dial, when not the bound one
    kv_deadline_s: float = 330.0  # decode: reservation to the last KV byte of a request
    # dist off loopback: its TCPStore and gloo sockets have no authentication (kvtransfer/
    # dist_backend.py), so the operator must say the network is trusted.
    insecure_dist: bool = False
    threads: int = 1  # threads of this process: torch's and the native kernels' pool (worker/runtime.py)
    batch_invariant: bool = False  # kernels/batch_invariance.py's mode, set by configure_process
    # The host's core lease its launcher made (common/core_lease.py) and this worker's slot in
    # it; None: the worker uses its --threads alone (worker/core_share.py).
    core_lease: str | None = None
    core_lease_slot: int | None = None
    log_level: str = "INFO"
    cluster_auth: ClusterAuth | None = field(default=None, repr=False)  # None: no secret, no TLS

    def __post_init__(self) -> None:
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(ENGINE_ROLES)}, got {self.role!r}")
        if self.engine.role != self.role:
            raise ValueError(f"the engine's role {self.engine.role!r} is not the worker's {self.role!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"kv_backend must be one of {', '.join(KV_BACKENDS)}, "
                             f"got {self.kv_backend!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.kv_port < 65536:
            raise ValueError(f"ports must be in 0..65535, got port={self.port}, "
                             f"kv_port={self.kv_port}")
        coordinator_list(self.coordinator)  # ValueError naming a bad entry
        if not self.coordinator_retry_s >= 0:
            raise ValueError(f"coordinator_retry_s must be >= 0, got {self.coordinator_retry_s}")
        if not self.kv_deadline_s > 0:
            raise ValueError(f"kv_deadline_s must be > 0, got {self.kv_deadline_s}")
        if self.kv_backend == "dist" and not self.insecure_dist and not (
                is_loopback(self.host) and is_loopback(self.advertised)):
            raise ValueError(f"--kv-backend dist off loopback (host {self.host!r}) needs "
                             f"--insecure-dist: its TCPStore and gloo connections are not "
                             f"authenticated, even with a cluster secret, and a peer that "
                             f"reaches them can end this process; use zmq or grpc, or pass "
                             f"--insecure-dist on a network where every host is trusted")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if (self.core_lease is None) != (self.core_lease_slot is None):
            raise ValueError("--core-lease and --core-lease-slot go together (the launcher gives both)")
        if self.core_lease is not None:
            if self.role not in ("prefill", "decode"):
                raise ValueError(f"a core lease is shared by prefill and decode workers; a "
                                 f"{self.role} worker has both roles' work in one process already")
            if isinstance(self.core_lease_slot, bool) or not isinstance(self.core_lease_slot, int) \
                    or self.core_lease_slot < 0:
                raise ValueError(f"core_lease_slot must be >= 0, got {self.core_lease_slot!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """From worker_arg_parser's Namespace (read, never changed). Resolves --device here,
        so a CUDA-less host fails before the model loads, and reads the cluster's secret and
        TLS files (ValueError for either)."""
        from common.cluster_auth import auth_from_args
        from engine.device import resolve_device

        from engine.speculative_config import parse_speculative

        auth = auth_from_args(args)
        device = str(resolve_device(args.device).torch_device)
        speculative = parse_speculative(args.speculative)  # checked on every role
        if args.role == "prefill":
            speculative = None  # nothing to speculate on: the flag is the decode workers'

        engine = EngineConfig.for_role(
            args.role, args.decode_quant, args.prefill_quant,
            cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)),
                              kv_dtype=args.kv_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                      max_num_seqs=args.max_num_seqs,
                                      long_prefill_token_threshold=args.max_chunk_tokens),
            device=device, cuda_graphs=not args.no_cuda_graphs, speculative=speculative)
        return cls(model=args.model, port=args.port, role=args.role, engine=engine,
                   host=args.host, advertise_host=args.advertise_host,
                   coordinator=args.coordinator, coordinator_retry_s=args.coordinator_retry,
                   worker_id=args.worker_id,
                   kv_backend=args.kv_backend, kv_port=args.kv_port,
                   kv_advertise=args.kv_advertise, kv_deadline_s=args.kv_deadline,
                   insecure_dist=args.insecure_dist,
                   threads=args.threads, batch_invariant=args.batch_invariant,
                   core_lease=args.core_lease,
                   core_lease_slot=args.core_lease_slot, log_level=args.log_level,
                   cluster_auth=auth)

    @property
    def coordinators(self) -> tuple[str, ...]:
        """Every coordinator registry this worker registers with (none: it runs alone)."""
        return coordinator_list(self.coordinator)

    @property
    def advertised(self) -> str:
        """The host peers reach this worker at."""
        return self.advertise_host or self.host
