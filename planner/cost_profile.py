"""Per-pass cost models of one worker on one host, fitted from tandem's own benchmarks.

    prefill pass   s = a + b * T + c * sum_i n_i * (ctx_i + n_i / 2)
                   T tokens in the pass; chunk i has n_i tokens after ctx_i cached ones, so
                   the last term counts the (causal) attention pairs: quadratic in a prompt
                   cut into one pass, linear in each chunk of a long one.
    decode step    s = a + b * B + c * S
                   B sequences in the batch, S the sum of their context lengths (the KV a
                   step reads; weights are read once per step, which is `a`).
    KV transfer    s = latency + bytes / bytes_per_s, bytes = tokens * kv_bytes_per_token
    coordinator    a fixed delay between arrival and the request reaching the workers.
    serving        decode_step_overhead_s: what a served decode step adds to the engine's
                   (the worker's loop, each token streamed to the coordinator and the client);
                   prefill_pass_overhead_s: what a served prefill pass costs beyond the
                   fitted engine pass (the worker's loop and sampling, the KV connector's
                   per-layer hand-offs, its sender thread beside the compute, and the engine
                   fit's own error at served lengths), as a fixed cost per pass (traced
                   passes under load here ran a near-constant 35-45 ms over the fit from 30
                   to 500 tokens). They and the coordinator's delay are what a served request
                   costs beyond the engine: benchmarks.profile_host measures all three on a
                   running cluster, one request at a time (0 where not measured). A pass's
                   overhead is kept apart from the coordinator's delay because it holds the
                   prefill worker: a request queued behind a pass waits for it too, while a
                   delay in the coordinator delays only its own request.
                   request_side_cpu_s: the CPU a remotely prefilled request costs the
                   workers beside their compute threads (the RPCs, the KV transfer's setup
                   and per-layer work at both ends: ~40 ms a request here, little of it per
                   byte or per output token), spent during its prefill. On a shared host it takes cores from the
                   workers (planner/simulator.py); measured by profile_host's served run from
                   the workers' threads' CPU time.

Fitted by least squares (planner/least_squares.py) from the JSON that
`benchmarks.bench_engine --json` and `benchmarks.bench_kvtransfer --json` print; saved and
loaded as JSON. Coefficients are clamped at >= 0: a negative per-token cost is a fit through
noise, and the simulator's closed forms assume costs grow with work.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.least_squares import fit

SCHEMA = "tandem-cost-profile/1"


@dataclass(frozen=True)
class CostProfile:
    prefill_base_s: float          # fixed cost of a prefill pass (launch, lm_head of 1 row)
    prefill_per_token_s: float     # per token in the pass (GEMMs)
    prefill_per_pair_s: float      # per (query, cached key) pair (attention)
    decode_base_s: float           # fixed cost of a decode step (every weight read once)
    decode_per_seq_s: float        # per sequence in the batch (GEMV rows, sampling)
    decode_per_ctx_token_s: float  # per cached token read by a step (paged attention)
    kv_bytes_per_token: float      # KV of one token, every layer, K and V
    transfer_bytes_per_s: float    # KV transfer throughput between a prefill and decode worker
    transfer_latency_s: float      # fixed cost of one request's transfer (grant, finish ack)
    coordinator_overhead_s: float = 0.0  # arrival -> request at the workers
    decode_step_overhead_s: float = 0.0  # a served decode step beyond the engine's
    prefill_pass_overhead_s: float = 0.0  # a served prefill pass beyond the engine's
    request_side_cpu_s: float = 0.0  # CPU beside the workers' compute threads, per remote prefill
    block_size: int = 16           # tokens per KV block
    source: str = ""               # what it was measured on (host CPU, model, format)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, float) and (not math.isfinite(value) or value < 0):
                raise ValueError(f"CostProfile.{name} must be finite and >= 0, got {value!r}")
        if self.transfer_bytes_per_s <= 0:
            raise ValueError(f"CostProfile.transfer_bytes_per_s must be > 0, got {self.transfer_bytes_per_s}")
        if self.block_size < 1:
            raise ValueError(f"CostProfile.block_size must be >= 1, got {self.block_size}")
        if self.prefill_base_s + self.prefill_per_token_s <= 0 or self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("CostProfile: a pass must cost time (base and per-token costs are all 0)")

    # -- the cost models -------------------------------------------------------------------

    def prefill_pass_s(self, tokens: int, pairs: float) -> float:
        """One prefill pass of `tokens` tokens whose chunks sum to `pairs` attention pairs
        (see chunk_pairs)."""
        return (self.prefill_base_s + self.prefill_pass_overhead_s + self.prefill_per_token_s * tokens
                + self.prefill_per_pair_s * pairs)

    def prefill_alone_s(self, tokens: int, budget: int) -> float:
        """A prompt of `tokens` prefilled alone on a worker: its chunks of at most `budget`
        tokens one pass after another."""
        if budget < 1:
            raise ValueError(f"prefill_alone_s: budget must be >= 1 token, got {budget}")
        seconds, done = 0.0, 0
        while done < tokens:
            n = min(budget, tokens - done)
            seconds += self.prefill_pass_s(n, self.chunk_pairs(n, done))
            done += n
        return seconds

    @staticmethod
    def chunk_pairs(n: int, ctx: int) -> float:
        """Attention pairs of a chunk of n tokens after ctx cached ones."""
        return n * (ctx + n / 2)

    def decode_step_s(self, batch: int, context_sum: int) -> float:
        return (self.decode_base_s + self.decode_step_overhead_s + self.decode_per_seq_s * batch
                + self.decode_per_ctx_token_s * context_sum)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_latency_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "CostProfile":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a cost profile: schema {data.get('schema')!r}, expected {SCHEMA!r}")
        fields = {k: v for k, v in data.items() if k != "schema"}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"cost profile: unknown fields {sorted(unknown)}")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(f"cost profile: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None
        return cls.from_json(data)


# -- fitting from the benchmarks' JSON -------------------------------------------------------

def engine_points(bench_engine_runs: list[list[dict]], fmt: str | None = None):
    """(prefill points, decode points, kv bytes per token) from one or more outputs of
    `bench_engine --json --one-level` (each a list of levels, each with rows per format that
    carry prompt_len and context, and may carry prefill_points: more prompt lengths' single
    passes). Prefill points are (tokens, pairs, seconds) of one prompt in one pass; decode
    points are (batch, context sum, seconds)."""
    prefill, decode, kv_per_token = [], [], []
    for levels in bench_engine_runs:
        for level in levels:
            for row in level["rows"]:
                if fmt is not None and row["format"] != fmt:
                    continue
                if "prompt_len" not in row or "context" not in row:
                    raise ValueError("bench_engine JSON rows lack prompt_len/context: rerun a "
                                     "bench_engine that writes them")
                n, ctx = row["prompt_len"], row["context"]
                prefill.append((n, CostProfile.chunk_pairs(n, 0), n / row["prefill_tok_s"]))
                prefill.extend((m, CostProfile.chunk_pairs(m, 0), s) for m, s in row.get("prefill_points", ()))
                for d in row["decode"]:
                    decode.append((d["batch"], d["batch"] * ctx, d["step_s"]))
                    kv_per_token.append(d["kv_bytes"] / (d["batch"] * ctx))
    if not prefill or not decode:
        raise ValueError(f"no bench_engine rows{'' if fmt is None else f' of format {fmt!r}'}")
    return prefill, decode, max(kv_per_token)


def transfer_points(bench_kvtransfer: dict, backend: str) -> tuple[list[tuple[float, float]], float]:
    """(bytes, seconds) per prompt size of one backend from `bench_kvtransfer --json`, and
    the layout's KV bytes per token."""
    layout = bench_kvtransfer["layout"]
    per_token = layout["bytes_per_token"]
    if backend not in bench_kvtransfer["gb_s"]:
        raise ValueError(f"bench_kvtransfer JSON has no backend {backend!r} "
                         f"(it has {sorted(bench_kvtransfer['gb_s'])})")
    points = []
    for tokens, gb_s in bench_kvtransfer["gb_s"][backend].items():
        nbytes = int(tokens) * per_token
        points.append((nbytes, nbytes / (gb_s * 1e9)))
    return points, per_token


def fit_profile(bench_engine_runs: list[list[dict]], bench_kvtransfer: dict | None, *,
                prefill_format: str | None = None, decode_format: str | None = None,
                backend: str = "zmq", coordinator_overhead_s: float = 0.0,
                block_size: int = 16, source: str = "") -> CostProfile:
    """Prefill costs from the rows of prefill_format, decode costs from those of
    decode_format (None: every row), as a prefill and a decode worker run different weight
    formats (tandem's --prefill-quant, --decode-quant)."""
    prefill, _, _ = engine_points(bench_engine_runs, prefill_format)
    _, decode, kv_per_token = engine_points(bench_engine_runs, decode_format)
    pa, pb, pc = fit([(1.0, n, pairs) for n, pairs, _ in prefill], [s for *_, s in prefill])
    da, db, dc = fit([(1.0, b, ctx) for b, ctx, _ in decode], [s for *_, s in decode])
    if bench_kvtransfer is not None:
        points, _ = transfer_points(bench_kvtransfer, backend)
        lat, per_byte = fit([(1.0, b) for b, _ in points], [s for _, s in points])
        bytes_per_s = 1 / per_byte if per_byte > 0 else max(b / s for b, s in points)
    else:  # no transfer measured: the KV moves at no cost (stated in the profile's source)
        lat, bytes_per_s = 0.0, float("1e15")
        source = (source + "; " if source else "") + "transfer not measured"
    return CostProfile(prefill_base_s=pa, prefill_per_token_s=pb, prefill_per_pair_s=pc,
                       decode_base_s=da, decode_per_seq_s=db, decode_per_ctx_token_s=dc,
                       kv_bytes_per_token=kv_per_token, transfer_bytes_per_s=bytes_per_s,
                       transfer_latency_s=lat, coordinator_overhead_s=coordinator_overhead_s,
                       block_size=block_size, source=source)
