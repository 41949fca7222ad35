"""The cheapest topology that meets an SLO for a trace, found by simulating candidates.

    cost = prefill workers * prefill_cost + decode workers * decode_cost
           (1 and 1: workers; cores per worker: cores)

The search leans on one structural fact of disaggregation: TTFT is made on the prefill side
and TPOT on the decode side. So, per token budget, it finds the fewest prefill workers whose
TTFT p99 meets the SLO (with decode workers to spare, so the decode side does not shape it);
then, per decode batch cap, the fewest decode workers for which the whole SLO holds (TTFT
p99 and TPOT p99, nothing rejected, and with SearchSpace.failures nothing lost to them)
beside the cheapest prefill side. Each count starts from a
work estimate (total work / the trace's arrival span: every worker busy all the time), grows
until it meets or looks below when it already does, then bisects: both sides are monotone in their count
(another worker only takes load off the others) under least-loaded placement.
Every simulated candidate is kept, with its figures, as the table of what was tried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.cost_profile import CostProfile
from planner.metrics import SLO, Summary, percentile
from planner.simulator import ClusterConfig, WorkerFailure, simulate
from planner.trace import Request


@dataclass(frozen=True)
class SearchSpace:
    token_budgets: tuple[int, ...] = (512, 1024, 2048)
    max_batches: tuple[int, ...] = (64, 128, 256)
    max_workers: int = 100_000          # prefill + decode
    prefill_cost: float = 1.0           # cost of one prefill worker (1: count workers; or cores)
    decode_cost: float = 1.0
    kv_blocks_per_decode: int = 0       # 0 = unbounded
    # Worker failures every candidate must ride out (nothing lost, the SLO still met); a
    # failure of worker i makes i + 1 workers of its role the fewest a candidate has.
    failures: tuple[WorkerFailure, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_budgets or not self.max_batches or min(self.token_budgets + self.max_batches) < 1:
            raise ValueError("SearchSpace: token_budgets and max_batches must be non-empty and >= 1")
        if self.max_workers < 2:
            raise ValueError(f"SearchSpace.max_workers must be >= 2 (a prefill and a decode worker), got {self.max_workers}")
        if self.prefill_cost <= 0 or self.decode_cost <= 0:
            raise ValueError("SearchSpace: worker costs must be > 0")
        if sum(self.least(role) for role in ("prefill", "decode")) > self.max_workers:
            raise ValueError(f"SearchSpace: the failures name more workers than max_workers ({self.max_workers})")

    def least(self, role: str) -> int:
        """The fewest workers of `role` a candidate has: every failing worker must exist."""
        return max([f.index + 1 for f in self.failures if f.role == role], default=1)

    def config(self, prefill: int, decode: int, budget: int, batch: int) -> ClusterConfig:
        return ClusterConfig(prefill, decode, budget, batch, self.kv_blocks_per_decode,
                             failures=self.failures)


@dataclass(frozen=True)
class Candidate:
    config: ClusterConfig
    summary: Summary
    meets: bool          # the whole SLO (TTFT p99, TPOT p99, none rejected or lost)
    cost: float
    phase: str           # "prefill" (sizing TTFT) or "decode" (sizing the rest)


@dataclass(frozen=True)
class Plan:
    best: Candidate | None              # None: nothing within max_workers meets the SLO
    tried: tuple[Candidate, ...]
    prefill_lower_bound: dict = field(default_factory=dict)  # budget -> workers
    decode_lower_bound: dict = field(default_factory=dict)   # batch -> workers
    ttft_floor: dict = field(default_factory=dict)           # budget -> best reachable TTFT p99


def work_lower_bounds(trace: list[Request], profile: CostProfile, budget: int, batch: int) -> tuple[int, int]:
    """Workers needed if every one were busy the whole trace (no queueing slack at all): the
    prefill seconds of all prompts at full passes, and the decode seconds of all tokens at
    full batches, over the trace's arrival span."""
    span = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    p = profile
    pass_s = p.prefill_base_s + p.prefill_pass_overhead_s  # a pass's fixed cost, spread over its budget
    prefill_s = sum(r.prompt_tokens * (p.prefill_per_token_s + pass_s / budget)
                    + p.prefill_per_pair_s * r.prompt_tokens ** 2 / 2 for r in trace)
    decode_s = sum((r.output_tokens - 1) * (p.decode_base_s / batch + p.decode_per_seq_s
                                            + p.decode_per_ctx_token_s * (r.prompt_tokens + r.output_tokens / 2))
                   for r in trace)
    return max(1, math.floor(prefill_s / span)), max(1, math.floor(decode_s / span))


def ttft_floor(trace: list[Request], profile: CostProfile, budget: int) -> float:
    """TTFT p99 if every request had a prefill worker to itself: no topology does better, so
    an SLO below it is out of reach at this budget whatever the worker count (a long prompt's
    chunks run one after another on one worker)."""
    return percentile([profile.coordinator_overhead_s + profile.prefill_alone_s(r.prompt_tokens, budget)
                       for r in trace], 99)


class _Search:
    def __init__(self, trace, profile, slo, space):
        self.trace, self.profile, self.slo, self.space = trace, profile, slo, space
        self.tried: list[Candidate] = []
        self.cache: dict[ClusterConfig, Candidate] = {}

    def evaluate(self, config: ClusterConfig, phase: str) -> Candidate:
        if config not in self.cache:
            s = simulate(self.trace, self.profile, config, self.slo).summary
            c = Candidate(config, s, s.meets(self.slo),
                          config.prefill_workers * self.space.prefill_cost
                          + config.decode_workers * self.space.decode_cost, phase)
            self.cache[config] = c
            self.tried.append(c)
        return self.cache[config]

    def smallest(self, start: int, limit: int, ok, least: int = 1) -> int | None:
        """The least n in [least, limit] with ok(n), assuming ok is monotone: from `start`,
        grow by ~25% steps until ok, or, when `start` already is ok, look below it; then
        bisect. (The work bound is no bound on a finite trace: work arriving near its end
        finishes after it, so fewer workers than the bound can still meet the SLO.)"""
        if least > limit:
            return None
        n = min(max(least, start), limit)
        if ok(n):
            prev = least - 1
        else:
            prev = n
            while True:
                if n >= limit:
                    return None
                prev, n = n, min(limit, max(n + 1, math.ceil(n * 1.25)))
                if ok(n):
                    break
        while n - prev > 1:
            mid = (prev + n) // 2
            prev, n = (prev, mid) if ok(mid) else (mid, n)
        return n


def search(trace: list[Request], profile: CostProfile, slo: SLO, space: SearchSpace = SearchSpace()) -> Plan:
    s = _Search(trace, profile, slo, space)
    p_least, d_least = space.least("prefill"), space.least("decode")
    p_lb, d_lb = {}, {}
    for b in space.token_budgets:
        p_lb[b] = work_lower_bounds(trace, profile, b, max(space.max_batches))[0]
    for m in space.max_batches:
        d_lb[m] = work_lower_bounds(trace, profile, min(space.token_budgets), m)[1]
    # Decode workers to spare while sizing the prefill side: twice the most any batch cap needs.
    # (Plus one for each decode worker that dies, so the deaths do not shape TTFT either.)
    spare_d = (max(2 * max(d_lb.values()) + 1, d_least)
               + len({f.index for f in space.failures if f.role == "decode"}))
    prefill_need: dict[int, int] = {}
    floors = {b: ttft_floor(trace, profile, b) for b in space.token_budgets}
    for b in space.token_budgets:
        if floors[b] > slo.ttft_s:
            continue  # unreachable at this budget: simulating more workers cannot help
        def ttft_ok(n: int, b=b) -> bool:
            c = s.evaluate(space.config(n, spare_d, b, max(space.max_batches)), "prefill")
            return c.summary.rejected == c.summary.failed == 0 and c.summary.ttft_p99_s <= slo.ttft_s
        n = s.smallest(p_lb[b], space.max_workers - d_least, ttft_ok, p_least)
        if n is not None:
            prefill_need[b] = n
    best: Candidate | None = None
    if prefill_need:
        budget = min(prefill_need, key=lambda b: (prefill_need[b], -b))  # fewest; then the larger pass
        p = prefill_need[budget]
        for m in space.max_batches:
            def all_ok(n: int, m=m) -> bool:
                return s.evaluate(space.config(p, n, budget, m), "decode").meets
            n = s.smallest(d_lb[m], space.max_workers - p, all_ok, d_least)
            if n is not None:
                c = s.cache[space.config(p, n, budget, m)]
                if best is None or c.cost < best.cost:
                    best = c
    # The sizing phases can meet the SLO on the way (a prefill candidate with spare decode):
    # the answer is the cheapest candidate that met it, whichever phase tried it.
    meeting = [c for c in s.tried if c.meets]
    if meeting:
        best = min(meeting, key=lambda c: (c.cost, c.config.prefill_workers + c.config.decode_workers,
                                           c.summary.tpot_p99_s, c.summary.ttft_p99_s))
    return Plan(best, tuple(s.tried), p_lb, d_lb, floors)
