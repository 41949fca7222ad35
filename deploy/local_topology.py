"""The description of a tandem cluster on one host, built once from `tandem serve`'s arguments:
its models, how many workers of each role serve them, and the flags each process gets.
deploy/process_plan.py turns it into processes, deploy/local.py runs them. (A multi-host
topology file for `tandem launch` is deploy/topology.py.)

    topology = Topology(model="smollm2", model_path=path, prefill=1, decode=1)
    # several models: the same worker counts for each, one coordinator for all
    topology = Topology(model="smollm2", model_path=path, more_models=(("qwen3", path2),))
    # ... and counts of their own for some: qwen3 gets 2 prefill and 3 decode workers
    topology = Topology(..., model_workers=(("qwen3", 2, 3),))

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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DECODE_FORMATS, KV_DTYPES, PREFILL_FORMATS, CacheConfig
from engine.device import DEFAULT_DEVICE, check_device_spec
from engine.speculative_config import parse_speculative
from common.model_name import name_key
from common.log_format import LOG_FORMATS
from common.tracing import protocol_from, traces_url
from common.core_lease import Slot as CoreSlot
from worker.config import DEFAULT_KV_BACKEND, DEFAULT_TOKEN_BUDGET, KV_BACKENDS


def model_slug(name: str) -> str:
    """A model's name as part of a worker id: `qwen3:0.6b` -> `qwen3-0-6b`."""
    return re.sub(r"[^a-z0-9]+", "-", Path(name).name.lower()).strip("-") or "model"


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
        slugs = [model_slug(name) for name, _ in self.models]
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

