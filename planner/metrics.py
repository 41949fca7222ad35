"""The serving metrics, as DESIGN.md defines them, over simulated (or measured) requests.

    TTFT  arrival to the first content token
    TPOT  (E2E - TTFT) / (output tokens - 1); a one-token request has none
    ITL   gap between consecutive output tokens of one request (every gap of every request)
    throughput  requests/s and output tokens/s over the whole run
    goodput     requests/s that met their SLO: TTFT <= slo.ttft_s and TPOT <= slo.tpot_s
                (a one-token request is judged on TTFT alone)

"The whole run" is first arrival to last finish. Percentiles use the nearest rank
round(q/100 * (n-1)) of the sorted values, as benchmarks/bench_modes.py does, so simulated
and measured figures compare; ITL percentiles are weighted (the simulator reports a decode
segment's gaps as one value with a count, see simulator.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO bounds must be > 0, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")


@dataclass(frozen=True)
class RequestTimes:
    arrival_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo: SLO) -> bool:
        tpot = self.tpot_s
        return self.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def weighted_percentile(pairs: list[tuple[float, int]], q: float) -> float:
    """The value at nearest rank round(q/100 * (N-1)) among N = sum of weights values, each
    pair (value, weight) standing for `weight` copies of `value`."""
    total = sum(w for _, w in pairs)
    if total == 0:
        return math.nan
    rank = min(total - 1, int(round(q / 100 * (total - 1))))
    seen = 0
    for value, weight in sorted(pairs):
        seen += weight
        if seen > rank:
            return value
    return sorted(pairs)[-1][0]  # unreachable: the ranks add up to total


@dataclass(frozen=True)
class Summary:
    requests: int
    rejected: int                   # could never fit a decode worker's KV pool
    duration_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    throughput_rps: float
    output_tok_s: float
    goodput_rps: float              # requests/s that met the SLO (nan without one)
    slo_attainment: float           # share of requests that met it
    failed: int = 0                 # lost to worker failures (moved too often, or no worker left)
    migrations: int = 0             # moves after a worker failure (each request's, all counted)

    def meets(self, slo: SLO) -> bool:
        """The plan's criterion: p99 TTFT and p99 TPOT within the SLO, nothing rejected or lost."""
        return (self.rejected == 0 and self.failed == 0 and self.ttft_p99_s <= slo.ttft_s
                and not self.tpot_p99_s > slo.tpot_s)


def summarize(times: list[RequestTimes], itl: list[tuple[float, int]], slo: SLO | None,
              rejected: int = 0, failed: int = 0, migrations: int = 0) -> Summary:
    if not times:
        if not failed:
            raise ValueError("no finished requests to summarize")
        # Every request was lost to failures: nothing to take percentiles of, nothing met.
        nan = math.nan
        return Summary(requests=0, rejected=rejected, duration_s=0.0, ttft_p50_s=nan, ttft_p99_s=nan,
                       tpot_p50_s=nan, tpot_p99_s=nan, itl_p50_s=weighted_percentile(itl, 50),
                       itl_p90_s=weighted_percentile(itl, 90), itl_p99_s=weighted_percentile(itl, 99),
                       e2e_p50_s=nan, e2e_p99_s=nan, throughput_rps=0.0, output_tok_s=0.0,
                       goodput_rps=0.0 if slo is not None else nan,
                       slo_attainment=0.0 if slo is not None else nan, failed=failed, migrations=migrations)
    start = min(t.arrival_s for t in times)
    duration = max(t.finish_s for t in times) - start
    ttft = [t.ttft_s for t in times]
    tpot = [v for t in times if (v := t.tpot_s) is not None]
    e2e = [t.e2e_s for t in times]
    good = sum(t.meets(slo) for t in times) if slo is not None else math.nan
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: math.inf if n else 0.0)
    return Summary(
        requests=len(times), rejected=rejected, duration_s=duration,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        itl_p50_s=weighted_percentile(itl, 50), itl_p90_s=weighted_percentile(itl, 90),
        itl_p99_s=weighted_percentile(itl, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99),
        throughput_rps=per_s(len(times)), output_tok_s=per_s(sum(t.output_tokens for t in times)),
        goodput_rps=per_s(good) if slo is not None else math.nan,
        slo_attainment=good / len(times) if slo is not None else math.nan,
        failed=failed, migrations=migrations)
