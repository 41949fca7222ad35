"""Every flag that `tandem run`, `tandem serve` and the worker processes share, defined once,
with its default taken from one place (worker/config.py, engine/config.py). Torch-free at
import: the CLI and deploy/local.py read it.

    add_engine_flags     --prefill-quant --decode-quant --kv-dtype --speculative
                         --batch-invariant --device --no-cuda-graphs
    add_worker_flags     --threads --num-blocks      (serve: per worker; worker: its own)
    add_kv_backend_flag  --kv-backend
    worker_arg_parser    a worker's whole command line (prefill_node, decode_node)

Where a flag means the same thing in several processes, only its help differs by `scope`:
"run" (one colocated engine in this process), "serve" (passed to the workers a topology
starts, each to the roles that use it, deploy/local.py), "worker" (this worker process).
Values are checked by the config each process builds (WorkerConfig, deploy.local_topology.Topology),
which raises ValueError naming the bad value; argparse checks only the choices.
"""

from __future__ import annotations

import argparse

from common.log_format import add_log_flags
from common.tracing import add_tracing_flag

from engine.config import (
    DECODE_FORMATS, KV_DTYPES, PREFILL_FORMATS, CacheConfig, SchedulerConfig,
)
from engine.device import add_device_flags
from engine.speculative_config import SPECULATIVE_HELP
from worker.config import (
    DEFAULT_DECODE_QUANT, DEFAULT_PREFILL_QUANT, DEFAULT_TOKEN_BUDGET, KV_BACKENDS, WorkerConfig,
)

_QUANT_HELP = {
    "run": ("weight format of prompt-only passes",
            "weight format of every pass with a decode token"),
    "serve": ("weight format of the prefill workers (and of a colocated worker's prompt-only passes)",
              "weight format of the decode workers, every pass (and of a colocated worker's "
              "passes with decode tokens)"),
    # Each role packs only its own format (EngineConfig.for_role); a worker ignores the flag of
    # the other role, so one flag list can go to every worker of a topology.
    "worker": ("weight format of prefill workers (and of a colocated worker's prompt passes)",
               "weight format of decode workers, every pass (and of a colocated worker's passes "
               "with decode tokens)"),
}
# Speculation runs where tokens are decoded: a prefill worker takes the flag (one flag list
# goes to every worker of a topology) and ignores it.
_SPECULATIVE_WHERE = {"run": "", "serve": " (passed to decode and colocated workers only)",
                      "worker": " (a prefill worker ignores it)"}
_BATCH_INVARIANT_WHERE = {"run": "in this process", "serve": "in every worker",
                          "worker": "in this worker"}
_KV_DTYPE_WHERE = {"run": "of this process's engine",
                   "serve": "of every worker (prefill and decode must agree)",
                   "worker": "of this worker (its KV peers must agree)"}


def add_engine_flags(p: argparse.ArgumentParser, scope: str) -> None:
    prefill_help, decode_help = _QUANT_HELP[scope]
    p.add_argument("--prefill-quant", choices=PREFILL_FORMATS, default=DEFAULT_PREFILL_QUANT,
                   help=f"{prefill_help} (default {DEFAULT_PREFILL_QUANT}: fp32 where its copy takes <= 1/12 "
                        f"of the host's memory, or int4 in its place where int4 runs on AMX tiles and the "
                        f"file's projections are Q4_0/Q4_1/Q4_K/Q6_K blocks; else bf16 where <= 1/3, "
                        f"else w8a8)")
    p.add_argument("--decode-quant", choices=DECODE_FORMATS, default=DEFAULT_DECODE_QUANT,
                   help=f"{decode_help} (default {DEFAULT_DECODE_QUANT})")
    # Part of the KV layout: a prefill and a decode worker that exchange KV must agree on it
    # (registration and the KV handshake refuse a mismatch), so `tandem serve` gives every
    # worker of a topology the same value.
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=CacheConfig.kv_dtype,
                   help=f"element type of the KV cache {_KV_DTYPE_WHERE[scope]}; bf16 halves the "
                        f"cache and the KV transfers (default {CacheConfig.kv_dtype})")
    p.add_argument("--speculative", default=None, metavar="ngram:k=N",
                   help=f"{SPECULATIVE_HELP}{_SPECULATIVE_WHERE[scope]}")
    p.add_argument("--batch-invariant", action="store_true",
                   help=f"batch-invariant kernels {_BATCH_INVARIANT_WHERE[scope]}: a request's "
                        "logits, bit for bit, whatever it shares a pass with (other requests, "
                        "chunking, a prefix-cache hit); costs prefill speed "
                        "(kernels/batch_invariance.py; also TANDEM_BATCH_INVARIANT=1)")
    add_device_flags(p)


def add_worker_flags(p: argparse.ArgumentParser, scope: str) -> None:
    each = " per worker process" if scope == "serve" else " of this process"
    p.add_argument("--threads", type=int, default=WorkerConfig.threads,
                   help=f"threads{each}: torch's and the native kernels' pool (1: no extra thread; "
                        f"default {WorkerConfig.threads})")
    default = "1 GB of KV per worker" if scope == "serve" else "as many as --kv-cache-gb holds"
    p.add_argument("--num-blocks", type=int,
                   help=f"KV pool size{' per worker' if scope == 'serve' else ''}, in blocks "
                        f"(default: {default})")


def add_kv_backend_flag(p: argparse.ArgumentParser, auto: bool = False) -> None:
    """auto: the launcher of one host's workers picks (deploy/kv_backend_choice.py)."""
    if auto:
        p.add_argument("--kv-backend", choices=(*KV_BACKENDS, "auto"), default="auto",
                       help="KV transfer between prefill and decode workers (default auto: shm "
                            "where the workers compute on the CPU and /dev/shm holds every "
                            "decode worker's KV pool, else zmq; the choice is logged)")
        return
    p.add_argument("--kv-backend", choices=KV_BACKENDS, default=WorkerConfig.kv_backend,
                   help=f"KV transfer between prefill and decode workers "
                        f"(default {WorkerConfig.kv_backend})")


def worker_arg_parser(prog: str, roles: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command line of `python -m prefill_node` / `python -m decode_node`; its Namespace
    becomes a WorkerConfig (WorkerConfig.from_args)."""
    w, cache = WorkerConfig, CacheConfig
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model", required=True, help="model name, GGUF file or HF directory")
    p.add_argument("--host", default=w.host, help=f"address of the gRPC server (default {w.host})")
    p.add_argument("--port", type=int, required=True, help="port of the gRPC server (0: any free one, registered with the coordinator)")
    p.add_argument("--advertise-host", help="host the coordinator and peers use to reach this worker")
    p.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   help="the coordinator's registry, or several coordinators' (comma-separated): "
                        "the worker registers and heartbeats with each on its own, and serves "
                        "every one of them (omit to run alone)")
    p.add_argument("--coordinator-retry", type=float, default=w.coordinator_retry_s,
                   help="seconds to keep retrying an unreachable coordinator (at start or after "
                        "losing it, so a restarted one finds us) before giving it up; the worker "
                        "exits once every coordinator it lists is given up; 0 = forever "
                        f"(default {w.coordinator_retry_s:g})")
    add_kv_backend_flag(p)
    p.add_argument("--insecure-dist", action="store_true",
                   help="allow --kv-backend dist off loopback: its TCPStore and gloo sockets are "
                        "not authenticated (a peer that reaches them can end a worker); only on "
                        "a network where every host is trusted")
    p.add_argument("--kv-port", type=int, default=w.kv_port,
                   help="decode: port of the KV receiver (0 = any)")
    p.add_argument("--kv-advertise", default=None,
                   help="decode: the KV endpoint peers connect to (e.g. tcp://HOST:PORT), when it "
                        "differs from the bound one: a port forward, NAT, a proxy in the path")
    p.add_argument("--kv-deadline", type=float, default=w.kv_deadline_s,
                   help="decode: seconds from reservation until all of a request's KV must have "
                        f"arrived (default {w.kv_deadline_s:g})")
    p.add_argument("--worker-id", default=None, help="name in the registry (default ROLE-random)")
    p.add_argument("--role", default=roles[0], choices=roles, help=f"(default {roles[0]})")
    p.add_argument("--max-batched-tokens", type=int, default=DEFAULT_TOKEN_BUDGET,
                   help=f"per-pass token budget (default {DEFAULT_TOKEN_BUDGET})")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help=f"most requests in one pass (default {SchedulerConfig.max_num_seqs})")
    p.add_argument("--max-chunk-tokens", type=int,
                   default=SchedulerConfig.long_prefill_token_threshold,
                   help="largest prefill chunk of one request per pass, on top of the "
                        "coordinator's per-request chunk plan (0 = the budget; default 0)")
    p.add_argument("--block-size", type=int, default=cache.block_size,
                   help=f"tokens per KV block (default {cache.block_size})")
    p.add_argument("--kv-cache-gb", type=float, default=cache.kv_cache_bytes / (1 << 30),
                   help="KV pool size in GiB when --num-blocks is not given (default 1)")
    add_engine_flags(p, "worker")
    add_worker_flags(p, "worker")
    p.add_argument("--core-lease", metavar="PATH",
                   help="the host's core lease file its launcher made (`tandem serve` gives it): "
                        "a decode worker runs its native kernels on idle prefill workers' cores "
                        "too, a prefill worker says when it is busy (common/core_lease.py)")
    p.add_argument("--core-lease-slot", type=int, metavar="N",
                   help="this worker's slot in --core-lease")
    add_log_flags(p)  # --log-level, --log-format (common/log_format.py)
    add_tracing_flag(p)  # --otlp-traces-endpoint (common/tracing.py)
    from common.cluster_auth import add_auth_args  # imports grpc: kept off the CLI's start-up

    add_auth_args(p)
    return p
