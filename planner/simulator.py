"""A discrete-event simulator of a disaggregated tandem cluster, driven by a CostProfile.

What one request goes through, as DESIGN.md's request flow has it:

    arrival --(coordinator overhead)--> coordinator queue (FIFO)
      admitted when the least-loaded decode worker (fewest reserved KV blocks) can reserve
      ceil((prompt + output) / block_size) blocks; placed on the prefill worker with the
      fewest queued prompt tokens
    prefill worker: passes of <= token_budget tokens, FIFO over its queue: the request at the
      head continues its prompt, the next ones are packed in, the last one cut (chunked
      prefill, as engine/scheduler.py schedules a prefill-only worker)
    last chunk's pass ends  -> first token (TTFT); the KV, streamed layer by layer while the
      chunks ran, lands at max(pass end, first chunk start + bytes / bandwidth) + latency
    decode worker: joins the running batch at the next step boundary when it has a slot
      (< max_batch), else waits; one token per step; leaves after output - 1 steps and frees
      its blocks, which may admit queued requests.

Closed forms instead of per-token events: between two changes of a decode worker's batch
(a join or a finish) every step has the same batch B and a context sum growing by B per step,
so step i of that segment lasts d0 + i * c * B (c = decode_per_ctx_token_s) and k steps take
k * d0 + c * B * k * (k - 1) / 2. A segment is one event; a request landing mid-segment cuts
it at the next step boundary (found by bisection). Each request knows the worker step at
which it finishes, so nothing walks the batch per step. ITL is recorded per segment as its
mean step with a weight of B * steps (less the joiners' first gaps, each recorded on its own),
so all gaps together add up exactly to the requests' first-token-to-finish times.

A shared host (ClusterConfig.host_cores > 0): every worker runs on the same `host_cores`
cores, beside `background_cores` of other work (the coordinator, a load generator), and the
cores are shared equally among whatever computes (processor sharing): while n workers
compute, each runs at min(1, host_cores / (n + background_cores)) of its profile's speed
(the profile was measured with a core to itself). A prefill pass's remaining work is
rescheduled exactly whenever n changes; a decode segment is cut at its next step boundary
and resumes at the new speed. host_cores 0 (the default): each worker has its own cores.

Not modeled: preemption (blocks for the whole output are reserved at admission, which is
conservative), prefix caching, conditional disaggregation (prefill on the decode worker),
colocated workers, contention between transfers on a link, migration after a failure,
network latency to the client, heterogeneous workers, and a worker borrowing an idle one's
core (the core lease).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from planner.cost_profile import CostProfile
from planner.metrics import SLO, RequestTimes, Summary, summarize
from planner.trace import Request


@dataclass(frozen=True)
class ClusterConfig:
    prefill_workers: int
    decode_workers: int
    token_budget: int = 512          # tokens per prefill pass (tandem's --chunk-size)
    max_batch: int = 64              # running sequences per decode worker (--max-num-seqs)
    kv_blocks_per_decode: int = 0    # KV pool of a decode worker in blocks; 0 = unbounded
    host_cores: float = 0.0          # > 0: every worker shares these cores (module docstring)
    background_cores: float = 0.0    # ... with this much other work running on them

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "token_budget", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_blocks_per_decode < 0:
            raise ValueError(f"ClusterConfig.kv_blocks_per_decode must be >= 0, got {self.kv_blocks_per_decode}")
        for name in ("host_cores", "background_cores"):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"ClusterConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SimResult:
    times: list[RequestTimes]        # per finished request, in trace order
    itl: list[tuple[float, int]]     # (gap seconds, how many gaps of that length)
    summary: Summary
    prefill_passes: int              # forward passes all prefill workers ran
    prefill_busy: float              # mean share of the run a prefill worker computed
    mean_decode_batch: float         # decode tokens per decode step, over all steps


@dataclass
class _Req:
    arrival: float
    prompt: int
    output: int
    blocks: int
    remaining: int = 0               # prompt tokens not yet prefilled
    first_chunk_s: float = -1.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    decode: int = -1


@dataclass
class _Prefill:
    queue: deque = field(default_factory=deque)   # _Req, FIFO
    queued_tokens: int = 0
    busy: bool = False
    chunks: list = field(default_factory=list)    # the running pass: (req, tokens)
    pass_tokens: int = 0
    # Shared host: the running pass's work left (seconds at full speed) as of `since`, and
    # the version of its live end event (older ones are stale).
    work_left: float = 0.0
    since: float = 0.0
    pass_start: float = 0.0
    version: int = 0


@dataclass
class _Decode:
    reserved: int = 0                # KV blocks of the requests placed here
    waiting: deque = field(default_factory=deque) # KV landed, no batch slot yet
    running: int = 0                 # B
    context_sum: int = 0             # S: tokens the next step reads, over the batch
    step: int = 0                    # steps completed since the start
    finishes: list = field(default_factory=list)  # heap of (finish step, seq, req)
    joiners: list = field(default_factory=list)   # joined at this segment's start
    active: bool = False
    t0: float = 0.0
    n: int = 0                       # steps in the current segment
    d0: float = 0.0                  # its first step's duration
    slowdown: float = 1.0            # shared host: its steps' time over the profile's
    version: int = 0                 # bumped when a segment is cut: stale end events drop


_ARRIVE, _PASS_END, _KV_READY, _SEG_END = range(4)


class Simulator:
    def __init__(self, profile: CostProfile, config: ClusterConfig) -> None:
        self.p = profile
        self.c = config
        self.events: list = []
        self.seq = 0
        self.prefills = [_Prefill() for _ in range(config.prefill_workers)]
        self.decodes = [_Decode() for _ in range(config.decode_workers)]
        # Least-loaded picks by lazy heaps: an entry is live only while its load is current.
        self.prefill_heap = [(0, i) for i in range(config.prefill_workers)]
        self.decode_heap = [(0, i) for i in range(config.decode_workers)]
        self.pending: deque[_Req] = deque()
        self.itl: list[tuple[float, int]] = []
        self.passes = 0
        self.busy_s = 0.0
        self.decode_tokens = 0
        self.decode_steps = 0
        self.computing = 0               # workers computing now (busy prefill, active decode)
        self.slowdown = 1.0              # shared host: time over the profile's, for all of them

    def push(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    # -- the run ---------------------------------------------------------------------------

    def run(self, trace: list[Request], slo: SLO | None = None) -> SimResult:
        reqs = [_Req(r.arrival_s, r.prompt_tokens, r.output_tokens,
                     -(-(r.prompt_tokens + r.output_tokens) // self.p.block_size)) for r in trace]
        cap = self.c.kv_blocks_per_decode
        rejected = [r for r in reqs if cap and r.blocks > cap]
        overhead = self.p.coordinator_overhead_s
        arrivals = iter(r for r in reqs if not (cap and r.blocks > cap))
        nxt = next(arrivals, None)
        while nxt is not None or self.events:
            # Arrivals are merged in from the (sorted) trace instead of all sitting in the heap.
            if nxt is not None and (not self.events or nxt.arrival + overhead <= self.events[0][0]):
                self.arrive(nxt.arrival + overhead, nxt)
                nxt = next(arrivals, None)
                continue
            t, _, kind, a, b = heapq.heappop(self.events)
            if kind == _PASS_END:
                if b == self.prefills[a].version:
                    self.pass_end(t, a)
            elif kind == _KV_READY:
                self.kv_ready(t, a, b)
            elif kind == _SEG_END:
                self.segment_end(t, a, b)
        done = [r for r in reqs if not (cap and r.blocks > cap)]
        if self.pending or any(d.running or d.waiting for d in self.decodes):
            raise RuntimeError("simulation ended with requests still queued (a bug)")
        times = [RequestTimes(r.arrival, r.first_token_s, r.finish_s, r.output) for r in done]
        if not times:
            raise ValueError("no request fits a decode worker's KV pool")
        summary = summarize(times, self.itl, slo, rejected=len(rejected))
        return SimResult(times, self.itl, summary, self.passes,
                         self.busy_s / (self.c.prefill_workers * summary.duration_s) if summary.duration_s else 0.0,
                         self.decode_tokens / self.decode_steps if self.decode_steps else 0.0)

    # -- coordinator -----------------------------------------------------------------------

    def arrive(self, t: float, r: _Req) -> None:
        self.pending.append(r)
        self.admit(t)

    def admit(self, t: float) -> None:
        """FIFO: the head waits for room and everything behind it waits too, as the
        coordinator's queue does (no overtaking, so no starvation of long requests)."""
        cap = self.c.kv_blocks_per_decode
        while self.pending:
            r = self.pending[0]
            d = self._least(self.decode_heap, lambda i: self.decodes[i].reserved)
            if cap and self.decodes[d].reserved + r.blocks > cap:
                return
            self.pending.popleft()
            self.decodes[d].reserved += r.blocks
            heapq.heappush(self.decode_heap, (self.decodes[d].reserved, d))
            r.decode = d
            p = self._least(self.prefill_heap, lambda i: self.prefills[i].queued_tokens)
            w = self.prefills[p]
            r.remaining = r.prompt
            w.queue.append(r)
            w.queued_tokens += r.prompt
            heapq.heappush(self.prefill_heap, (w.queued_tokens, p))
            if not w.busy:
                self.start_pass(t, p)

    @staticmethod
    def _least(heap: list, load) -> int:
        while heap[0][0] != load(heap[0][1]):
            heapq.heappop(heap)  # stale: that worker's load changed since
        return heap[0][1]

    # -- prefill workers ---------------------------------------------------------------------

    def start_pass(self, t: float, p: int) -> None:
        w = self.prefills[p]
        left, pairs, w.chunks = self.c.token_budget, 0.0, []
        for r in w.queue:  # head first: its next chunk, then the next requests packed in
            n = min(r.remaining, left)
            pairs += CostProfile.chunk_pairs(n, r.prompt - r.remaining)
            if r.first_chunk_s < 0:
                r.first_chunk_s = t
            w.chunks.append((r, n))
            left -= n
            if not left:
                break
        w.pass_tokens = self.c.token_budget - left
        cost = self.p.prefill_pass_s(w.pass_tokens, pairs)
        self.passes += 1
        w.work_left, w.since, w.pass_start = cost, t, t
        if not w.busy:
            w.busy = True
            self._computing(t, +1)
        self._schedule_pass_end(p)

    def _schedule_pass_end(self, p: int) -> None:
        w = self.prefills[p]
        w.version += 1
        self.push(w.since + w.work_left * self.slowdown, _PASS_END, p, w.version)

    def pass_end(self, t: float, p: int) -> None:
        w = self.prefills[p]
        self.busy_s += t - w.pass_start  # wall time: longer than its cost on a shared host
        for r, n in w.chunks:
            r.remaining -= n
            if r.remaining:
                continue  # only the pass's last chunk can be partial: it stays at the head
            w.queue.popleft()
            r.first_token_s = t
            landed = max(t, r.first_chunk_s + r.prompt * self.p.kv_bytes_per_token / self.p.transfer_bytes_per_s)
            self.push(landed + self.p.transfer_latency_s, _KV_READY, r.decode, r)
        w.queued_tokens -= w.pass_tokens
        heapq.heappush(self.prefill_heap, (w.queued_tokens, p))
        if w.queue:
            self.start_pass(t, p)  # still computing: the count of workers computing holds
        else:
            w.busy = False
            self._computing(t, -1)

    # -- a shared host --------------------------------------------------------------------------

    def _computing(self, t: float, change: int) -> None:
        """A worker started (+1) or stopped (-1) computing at t. On a shared host every other
        computing worker's speed changes with it: prefill passes are rescheduled from the work
        they have left, decode segments end at their next step boundary (and go on at the new
        speed from there)."""
        self.computing += change
        if self.c.host_cores <= 0:
            return
        slowdown = max(1.0, (self.computing + self.c.background_cores) / self.c.host_cores)
        if slowdown == self.slowdown:
            return
        old, self.slowdown = self.slowdown, slowdown
        for p, w in enumerate(self.prefills):
            if w.busy and w.since < t:
                w.work_left = max(0.0, w.work_left - (t - w.since) / old)
                w.since = t
                self._schedule_pass_end(p)
            elif w.busy:  # started at t: its end was scheduled at the old speed
                self._schedule_pass_end(p)
        for d, w in enumerate(self.decodes):
            if w.active and w.slowdown != slowdown:
                self.cut(d, t)

    # -- decode workers -----------------------------------------------------------------------

    def kv_ready(self, t: float, d: int, r: _Req) -> None:
        w = self.decodes[d]
        if r.output == 1:  # the prefill's token was the whole answer
            r.finish_s = r.first_token_s
            self.free(t, d, r)
            return
        w.waiting.append(r)
        if not w.active:
            self.boundary(t, d)
        elif w.running < self.c.max_batch:
            self.cut(d, t)

    def cut(self, d: int, t: float) -> None:
        """End the running segment at the first step boundary at or after t."""
        w = self.decodes[d]
        lo, hi = 1, w.n
        while lo < hi:
            mid = (lo + hi) // 2
            if w.t0 + self._steps_s(w, mid) >= t:
                hi = mid
            else:
                lo = mid + 1
        if lo < w.n:
            w.n = lo
            w.version += 1
            self.push(w.t0 + self._steps_s(w, lo), _SEG_END, d, w.version)

    def _steps_s(self, w: _Decode, k: int) -> float:
        return k * w.d0 + w.slowdown * self.p.decode_per_ctx_token_s * w.running * k * (k - 1) / 2

    def segment_end(self, t: float, d: int, version: int) -> None:
        w = self.decodes[d]
        if version != w.version:
            return
        b, n = w.running, w.n
        w.step += n
        w.context_sum += n * b
        self.decode_steps += n
        self.decode_tokens += n * b
        for r in w.joiners:  # their first decode token came at the end of step one
            self.itl.append((w.t0 + w.d0 - r.first_token_s, 1))
        j = len(w.joiners)
        if n * b > j:  # the other gaps: mean of the segment's steps, without the joiners' d0s
            self.itl.append(((b * self._steps_s(w, n) - j * w.d0) / (n * b - j), n * b - j))
        w.joiners = []
        while w.finishes and w.finishes[0][0] <= w.step:
            _, _, r = heapq.heappop(w.finishes)
            r.finish_s = t
            w.running -= 1
            w.context_sum -= r.prompt + r.output
            self.free(t, d, r)
        w.active = False
        self.boundary(t, d, resumed=True)
        if not w.active:  # nothing left to run: this worker stopped computing
            self._computing(t, -1)

    def boundary(self, t: float, d: int, resumed: bool = False) -> None:
        """A step boundary: waiting requests join up to max_batch, then the next segment runs
        until the earliest finish (or until a landing request cuts it). resumed: right after
        the worker's previous segment (it has been computing), else from idle."""
        w = self.decodes[d]
        while w.waiting and w.running < self.c.max_batch:
            r = w.waiting.popleft()
            w.running += 1
            w.context_sum += r.prompt + 1  # its KV plus the first token, fed back as input
            self.seq += 1
            heapq.heappush(w.finishes, (w.step + r.output - 1, self.seq, r))
            w.joiners.append(r)
        if not w.running:
            return
        if not resumed:  # counted before it is active: the rescale finds no segment of its own to cut
            self._computing(t, +1)
        w.active, w.t0 = True, t
        w.slowdown = self.slowdown
        w.n = w.finishes[0][0] - w.step
        w.d0 = self.p.decode_step_s(w.running, w.context_sum) * w.slowdown
        w.version += 1
        self.push(t + self._steps_s(w, w.n), _SEG_END, d, w.version)

    def free(self, t: float, d: int, r: _Req) -> None:
        w = self.decodes[d]
        w.reserved -= r.blocks
        heapq.heappush(self.decode_heap, (w.reserved, d))
        if self.pending:
            self.admit(t)


def simulate(trace: list[Request], profile: CostProfile, config: ClusterConfig,
             slo: SLO | None = None) -> SimResult:
    return Simulator(profile, config).run(trace, slo)
