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
so all gaps together add up exactly to the finished requests' first-token-to-finish times
(and, with failures, the lost ones' first to last token).

A shared host (ClusterConfig.host_cores > 0): every worker runs on the same `host_cores`
cores, beside `background_cores` of other work (the coordinator, a load generator), each
worker at 1 / (its share of a core) of its profile's speed (the profile was measured with a
core to itself). How the cores are shared (ClusterConfig.sharing):
  "per_core" (the default): as Linux's scheduler shares them, a run queue per core. A worker
  that starts computing joins the core with the fewest computing workers (the lowest index
  among those), and the workers on one core share it evenly; when one stops and leaves its
  core two short of the most crowded one (with two cores: idle beside two), that core gives
  its latest comer over (the idle balance), so the counts per core never differ by more
  than one. So where workers outnumber cores some run at full
  speed and some at half, not all at n / cores: measured with `perf sched` on a 1:2 cluster
  on 2 cores (stop 47), the three workers' shares while all three computed were 0.5, 0.5
  and 1.0 over stretches of 20-200 ms.
  "even": processor sharing, every computing worker at min(1, host_cores / (n +
  background_cores)), n the workers computing.
Background work takes the cores no worker computes on first; what does not fit there is
spread evenly over all cores. Besides `background_cores` it holds each running pass's side
work: the CPU its requests cost the workers beside their compute threads (the profile's
request_side_cpu_s per request, each chunk its share by tokens: the RPCs, the KV transfer at
both ends), spread over the pass as cores (side CPU / the pass's cost; a pass wasted by a
death keeps its share, and the moved requests pay theirs again). A prefill pass's remaining
work is rescheduled exactly whenever its speed changes; a decode segment is cut at its next
step boundary and resumes at the new speed. host_cores 0 (the default): each worker has its
own cores (and the side work is not modelled: a planned cluster's workers have spare cores
for it).

Worker failures and migration (ClusterConfig.failures): a worker dies at a given time, and
comes back empty after `restart_after_s` if one is given. What it held moves as
coordinator/request_flow.py moves it: every request placed on a dead decode worker, and every
one queued or in a pass on a dead prefill worker (or whose KV was still landing from it), is
placed again at once, ahead of the admission queue, with its prompt plus the tokens it had
(its first token, and the decode steps completed before the death; a step in progress is
lost), for what is left of its output, on the live workers; its KV reservation on the old
decode worker is gone with it. The client's stream goes on: TTFT stays the first token's,
and the gap from the last token before the death to the next one (the re-prefill's) is one
ITL. A prefill pass in progress on a live worker for a request that moved finishes as wasted
work. A request moved more than `max_migrations` times (tandem's default 2), or with no live
worker of a role left and none to come back, fails; so does one moved while no decode worker
is alive (the coordinator has nowhere to place it and ends it with an error). Lost requests
are counted in Summary.failed, never in the TTFT, TPOT and E2E percentiles (the gaps of the
tokens they did stream stay in the ITL record: the client saw them). The coordinator notices
a death at once (a stream cut or UNAVAILABLE).
A frozen worker (WorkerFailure.noticed_after_s > 0: a stopped or hung process) dies the same
way, but only that long after it froze, as the coordinator declares a silent worker dead at
its heartbeat deadline and then ends its calls (coordinator/registry.py): meanwhile it
computes nothing (a decode worker's completed steps count, the one in progress is lost; a
prefill pass in progress is lost), no KV lands from or on it, and the coordinator, which
still counts it alive, goes on placing requests on it, which move with the rest.
A frozen worker that thaws before its deadline (restart_after_s < noticed_after_s: a SIGSTOP
and SIGCONT, a swap storm, a VM paused for migration) is never declared dead, and nothing
moves: it resumes where it stopped. A prefill pass goes on with the work it had left; a
decode worker's batch runs on, each running request's gap across the freeze one ITL, the step
in progress at the freeze computed again from its start (conservative by at most one step:
tandem resumes it mid-step); no KV moves from or to it meanwhile (the receiver grants and
acks, the sender writes), so each transfer it is an end of goes on after the thaw with the
bytes it had left, and requests placed on it meanwhile start then. Thawing after the deadline
is the death above, then a restart.
Where it differs, conservatively: with no live prefill worker the coordinator prefills on a
decode worker (conditional disaggregation, not modelled), where the simulator waits for a
restart; new arrivals wait for a restart however long (the coordinator, up to its load
timeout); and a restarted worker may take back a request that died on it before (the
coordinator never places a request again on a worker that failed it). Failures of one worker
must not overlap in time (ClusterConfig refuses them).

Not modeled: preemption (blocks for the whole output are reserved at admission, which is
conservative), prefix caching, conditional disaggregation (prefill on the decode worker),
colocated workers, contention between transfers on a link, network latency to the client,
heterogeneous workers, a worker borrowing an idle one's core (the core lease), and the load
balancer's periodic moves of a worker between two busy cores (per_core sharing keeps a
worker on its core until a core goes idle; README, Planning a cluster).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from planner.cost_profile import CostProfile
from planner.metrics import SLO, RequestTimes, Summary, summarize
from planner.trace import Request


ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerFailure:
    """Worker `index` of `role` dies at `at_s` (trace time); restart_after_s: it comes back,
    empty, that long after (None: never). noticed_after_s > 0: it freezes at at_s instead
    (alive to the coordinator, working no more) and is declared dead that long after, as the
    coordinator declares a silent worker at its heartbeat deadline; a restart_after_s shorter
    than that is a thaw: it resumes where it stopped and is never declared dead (module
    docstring)."""
    role: str
    index: int
    at_s: float
    restart_after_s: float | None = None
    noticed_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"WorkerFailure.role must be one of {ROLES}, got {self.role!r}")
        if self.index < 0:
            raise ValueError(f"WorkerFailure.index must be >= 0, got {self.index}")
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"WorkerFailure.at_s must be a finite time >= 0, got {self.at_s}")
        if self.restart_after_s is not None and not (math.isfinite(self.restart_after_s)
                                                     and self.restart_after_s >= 0):
            raise ValueError(f"WorkerFailure.restart_after_s must be a finite time >= 0, got {self.restart_after_s}")
        if not (math.isfinite(self.noticed_after_s) and self.noticed_after_s >= 0):
            raise ValueError(f"WorkerFailure.noticed_after_s must be a finite time >= 0, got {self.noticed_after_s}")
        if self.thaws and self.restart_after_s == 0:
            raise ValueError("WorkerFailure: a freeze that thaws must last > 0 s, got 0")

    @property
    def thaws(self) -> bool:
        """A freeze that ends before the heartbeat deadline: nothing moves, it resumes."""
        return self.restart_after_s is not None and self.restart_after_s < self.noticed_after_s

    @property
    def until_s(self) -> float:
        """When the worker is back (inf: never)."""
        return math.inf if self.restart_after_s is None else self.at_s + self.restart_after_s

    @classmethod
    def parse(cls, spec: str, noticed_after_s: float = 0.0) -> "WorkerFailure":
        """ROLE:INDEX@SECONDS[+RESTART_SECONDS], e.g. decode:0@30 or prefill:1@12.5+20; a
        freeze where noticed_after_s > 0."""
        try:
            who, when = spec.split("@")
            role, index = who.split(":")
            at, plus, restart = when.partition("+")
            if plus and not restart:
                raise ValueError("no restart time after '+'")
            return cls(role.strip(), int(index), float(at), float(restart) if plus else None,
                       noticed_after_s)
        except ValueError as exc:
            raise ValueError(f"bad failure {spec!r} (ROLE:INDEX@SECONDS[+RESTART_SECONDS], "
                             f"e.g. decode:0@30 or prefill:1@12.5+20): {exc}") from None


SHARINGS = ("per_core", "even")


@dataclass(frozen=True)
class ClusterConfig:
    prefill_workers: int
    decode_workers: int
    token_budget: int = 512          # tokens per prefill pass (tandem's --chunk-size)
    max_batch: int = 64              # running sequences per decode worker (--max-num-seqs)
    kv_blocks_per_decode: int = 0    # KV pool of a decode worker in blocks; 0 = unbounded
    host_cores: float = 0.0          # > 0: every worker shares these cores (module docstring)
    background_cores: float = 0.0    # ... with this much other work running on them
    sharing: str = "per_core"        # how: "per_core" (a run queue per core) or "even" (module docstring)
    failures: tuple[WorkerFailure, ...] = ()  # module docstring: worker failures and migration
    max_migrations: int = 2          # moves per request before it fails (coordinator's default)

    def __post_init__(self) -> None:
        for name in ("prefill_workers", "decode_workers", "token_budget", "max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"ClusterConfig.max_migrations must be >= 0, got {self.max_migrations}")
        for f in self.failures:
            count = self.prefill_workers if f.role == "prefill" else self.decode_workers
            if f.index >= count:
                raise ValueError(f"failure of {f.role} worker {f.index}: the cluster has {count} {f.role} workers")
        # One worker's outages must not overlap (closed intervals: a restart at the instant of
        # the next death would make the outcome depend on the order the failures are listed).
        for i, a in enumerate(self.failures):
            for b in self.failures[i + 1:]:
                if (a.role, a.index) == (b.role, b.index) and b.at_s <= a.until_s and a.at_s <= b.until_s:
                    raise ValueError(f"failures of {a.role} worker {a.index} overlap: at {a.at_s:g} s and {b.at_s:g} s "
                                     f"(a worker must be back before it can die again)")
        if self.kv_blocks_per_decode < 0:
            raise ValueError(f"ClusterConfig.kv_blocks_per_decode must be >= 0, got {self.kv_blocks_per_decode}")
        for name in ("host_cores", "background_cores"):
            if not getattr(self, name) >= 0:  # also refuses nan
                raise ValueError(f"ClusterConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.sharing not in SHARINGS:
            raise ValueError(f"ClusterConfig.sharing must be one of {', '.join(SHARINGS)}, got {self.sharing!r}")
        if self.sharing == "per_core" and not (math.isfinite(self.host_cores)
                                               and self.host_cores == int(self.host_cores)):
            raise ValueError(f"ClusterConfig.host_cores must be a whole number of cores with per_core sharing, "
                             f"got {self.host_cores} (use sharing='even' for a fraction)")


@dataclass(frozen=True)
class SimResult:
    times: list[RequestTimes]        # per finished request, in trace order
    itl: list[tuple[float, int]]     # (gap seconds, how many gaps of that length)
    summary: Summary
    prefill_passes: int              # forward passes all prefill workers ran
    prefill_busy: float              # mean share of the run a prefill worker computed
    mean_decode_batch: float         # decode tokens per decode step, over all steps


class _State(enum.Enum):
    QUEUED = 0       # in the coordinator's queue (first placement, or a move waiting for room)
    PREFILL = 1      # on a prefill worker's queue or in its pass
    TRANSFER = 2     # prefilled; its KV still landing on the decode worker
    WAITING = 3      # landed, no batch slot yet
    RUNNING = 4      # in a decode worker's batch
    DONE = 5
    FAILED = 6


@dataclass(eq=False)  # identity: a request is a key of its decode worker's `placed`
class _Req:
    arrival: float
    prompt: int
    output: int
    blocks: int
    remaining: int = 0               # prompt tokens of this placement not yet prefilled
    first_chunk_s: float = -1.0
    first_token_s: float = -1.0
    last_token_s: float = 0.0        # the latest token the client has (its gap to the next is an ITL)
    finish_s: float = 0.0
    decode: int = -1
    prefill: int = -1
    state: _State = _State.QUEUED
    done: int = 0                    # tokens generated before this placement (moves carry them)
    attempt: int = 0                 # placements so far - 1: events of an older one are stale
    join_step: int = 0               # its decode worker's step count when it joined the batch
    transfer: int = 0                # version of its pending KV_READY event (a freeze delays it)
    held: bool = False               # its KV landing waits for a thaw (Simulator.held)

    @property
    def prompt_now(self) -> int:     # what this placement prefills: the prompt and tokens so far
        return self.prompt + self.done

    @property
    def output_now(self) -> int:     # tokens this placement generates
        return self.output - self.done


@dataclass
class _Prefill:
    queue: deque = field(default_factory=deque)   # _Req, FIFO
    queued_tokens: int = 0
    busy: bool = False
    chunks: list = field(default_factory=list)    # the running pass: (req, tokens, req's attempt)
    pass_tokens: int = 0
    # Shared host: the running pass's work left (seconds at full speed) as of `since`, and
    # the version of its live end event (older ones are stale).
    work_left: float = 0.0
    since: float = 0.0
    pass_start: float = 0.0
    slowdown: float = 1.0            # shared host: its pass's time over the profile's, now
    core: int = -1                   # per_core sharing: the core it computes on (-1: not computing)
    # Shared host: the CPU its pass's requests cost beside the compute threads (the profile's
    # request_side_cpu_s, each request's share by its chunk), as cores over the pass's cost.
    side_cores: float = 0.0
    version: int = 0
    alive: bool = True
    frozen: bool = False             # alive to the coordinator, computing and sending nothing
    frozen_at: float = 0.0           # when it froze (while frozen)
    paused_pass: bool = False        # frozen mid-pass: `chunks` resume with `work_left` at the thaw


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
    core: int = -1                   # per_core sharing: the core it computes on (-1: not computing)
    version: int = 0                 # bumped when a segment is cut or the worker dies: stale end events drop
    alive: bool = True
    frozen: bool = False             # alive to the coordinator, stepping and receiving nothing
    frozen_at: float = 0.0           # when it froze (while frozen)
    placed: dict = field(default_factory=dict)    # _Req -> None, in placement order


_ARRIVE, _PASS_END, _KV_READY, _SEG_END, _FAIL, _RESTART, _FREEZE, _THAW = range(8)


class Simulator:
    def __init__(self, profile: CostProfile, config: ClusterConfig) -> None:
        self.p = profile
        self.c = config
        self.events: list = []
        self.seq = 0
        self.prefills = [_Prefill() for _ in range(config.prefill_workers)]
        self.decodes = [_Decode() for _ in range(config.decode_workers)]
        # Least-loaded picks by lazy heaps: an entry is live only while its load is current
        # (a dead worker's load is inf, so its entries are all stale).
        self.prefill_heap = [(0, i) for i in range(config.prefill_workers)]
        self.decode_heap = [(0, i) for i in range(config.decode_workers)]
        self.pending: deque[_Req] = deque()
        self.itl: list[tuple[float, int]] = []
        self.passes = 0
        self.busy_s = 0.0
        self.decode_tokens = 0
        self.decode_steps = 0
        self.computing = 0               # workers computing now (busy prefill, active decode)
        # per_core sharing: the workers computing on each core, in the order they came (the
        # idle balance moves the latest). Invariant: their counts differ by at most one.
        self.cores: list[list] = ([[] for _ in range(int(config.host_cores))]
                                  if config.host_cores > 0 and config.sharing == "per_core" else [])
        self.spill = 0.0          # per_core: background work each core carries (none idle for it)
        self.even_slowdown = 1.0  # even: every computing worker's time over its profile's
        self.migrations = 0
        # (request, its attempt, transfer time left): KV whose landing waits for its frozen
        # decode or prefill worker to thaw (_hold); a death makes an entry stale.
        self.held: list[tuple[_Req, int, float]] = []

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
        for f in self.c.failures:
            if f.noticed_after_s > 0:
                self.push(f.at_s, _FREEZE, f.role, f.index)
            if f.thaws:
                self.push(f.at_s + f.restart_after_s, _THAW, f.role, f.index)
                continue
            self.push(f.at_s + f.noticed_after_s, _FAIL, f.role, f.index)
            if f.restart_after_s is not None:
                self.push(f.at_s + f.restart_after_s, _RESTART, f.role, f.index)
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
            elif kind == _FAIL:
                self.fail(t, a, b)
            elif kind == _FREEZE:
                self.freeze(t, a, b)
            elif kind == _THAW:
                self.thaw(t, a, b)
            else:
                self.restart(t, a, b)
        if self.pending and any(w.alive for w in self.prefills) and any(w.alive for w in self.decodes):
            raise RuntimeError("simulation ended with requests still queued (a bug)")
        for r in self.pending:  # no live worker of a role left, and none came back
            r.state = _State.FAILED
        self.pending.clear()
        if any(d.running or d.waiting for d in self.decodes):
            raise RuntimeError("simulation ended with requests still queued (a bug)")
        done = [r for r in reqs if r.state is _State.DONE]
        failed = sum(r.state is _State.FAILED for r in reqs)
        if len(done) + failed + len(rejected) != len(reqs):
            raise RuntimeError("simulation ended with requests neither finished nor lost (a bug)")
        times = [RequestTimes(r.arrival, r.first_token_s, r.finish_s, r.output) for r in done]
        if not times and not failed:
            raise ValueError("no request fits a decode worker's KV pool")
        summary = summarize(times, self.itl, slo, rejected=len(rejected), failed=failed,
                            migrations=self.migrations)
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
            d = self._least(self.decode_heap, self._decode_load)
            p = self._least(self.prefill_heap, self._prefill_load)
            if d < 0 or p < 0:  # every worker of a role is dead: wait for a restart
                return
            if cap and self.decodes[d].reserved + r.blocks > cap:
                return
            self.pending.popleft()
            if r.attempt:  # a move counts once it is placed, as the coordinator counts it
                self.migrations += 1
            self.decodes[d].reserved += r.blocks
            self.decodes[d].placed[r] = None
            heapq.heappush(self.decode_heap, (self.decodes[d].reserved, d))
            r.decode, r.prefill, r.state = d, p, _State.PREFILL
            w = self.prefills[p]
            r.remaining = r.prompt_now
            w.queue.append(r)
            w.queued_tokens += r.prompt_now
            heapq.heappush(self.prefill_heap, (w.queued_tokens, p))
            if not w.busy and not w.frozen:
                self.start_pass(t, p)

    def _decode_load(self, i: int) -> float:
        return self.decodes[i].reserved if self.decodes[i].alive else math.inf

    def _prefill_load(self, i: int) -> float:
        return self.prefills[i].queued_tokens if self.prefills[i].alive else math.inf

    @staticmethod
    def _least(heap: list, load) -> int:
        """The least loaded live worker, or -1 when none is alive."""
        while heap and heap[0][0] != load(heap[0][1]):
            heapq.heappop(heap)  # stale: that worker's load changed since (or it died)
        return heap[0][1] if heap else -1

    # -- prefill workers ---------------------------------------------------------------------

    def start_pass(self, t: float, p: int) -> None:
        w = self.prefills[p]
        left, pairs, w.chunks = self.c.token_budget, 0.0, []
        for r in w.queue:  # head first: its next chunk, then the next requests packed in
            n = min(r.remaining, left)
            pairs += CostProfile.chunk_pairs(n, r.prompt_now - r.remaining)
            if r.first_chunk_s < 0:
                r.first_chunk_s = t
            w.chunks.append((r, n, r.attempt))
            left -= n
            if not left:
                break
        w.pass_tokens = self.c.token_budget - left
        cost = self.p.prefill_pass_s(w.pass_tokens, pairs)
        self.passes += 1
        w.work_left, w.since, w.pass_start = cost, t, t
        side = 0.0
        if self.p.request_side_cpu_s > 0 and self.c.host_cores > 0:
            side = self.p.request_side_cpu_s * sum(n / max(1, r.prompt_now) for r, n, _ in w.chunks)
        side_cores, w.side_cores = w.side_cores, (side / cost if cost > 0 else 0.0)
        if not w.busy:
            w.busy = True
            self._computing(t, w, +1)
        elif w.side_cores != side_cores and self.c.host_cores > 0:
            self._respeed(t)  # the next pass of a busy worker: only the side work changed
        self._schedule_pass_end(p)

    def _schedule_pass_end(self, p: int) -> None:
        w = self.prefills[p]
        w.version += 1
        self.push(w.since + w.work_left * w.slowdown, _PASS_END, p, w.version)

    def pass_end(self, t: float, p: int) -> None:
        w = self.prefills[p]
        self.busy_s += t - w.pass_start  # wall time: longer than its cost on a shared host
        for r, n, attempt in w.chunks:
            if attempt != r.attempt:
                continue  # it moved during the pass (its decode worker died): wasted work
            r.remaining -= n
            w.queued_tokens -= n
            if r.remaining:
                continue  # only the pass's last chunk can be partial: it stays at the head
            w.queue.popleft()
            if r.first_token_s < 0:
                r.first_token_s = t
            else:  # a moved request's next token: the gap since its last one is an ITL
                self.itl.append((t - r.last_token_s, 1))
            r.last_token_s = t
            r.state = _State.TRANSFER
            landed = max(t, r.first_chunk_s + r.prompt_now * self.p.kv_bytes_per_token / self.p.transfer_bytes_per_s)
            self.push(landed + self.p.transfer_latency_s, _KV_READY, r.decode, (r, r.attempt, r.transfer))
        heapq.heappush(self.prefill_heap, (w.queued_tokens, p))
        if w.queue:
            self.start_pass(t, p)  # still computing: the count of workers computing holds
        else:
            w.busy = False
            self._computing(t, w, -1)

    # -- a shared host --------------------------------------------------------------------------

    def _computing(self, t: float, w: _Prefill | _Decode, change: int) -> None:
        """Worker w started (+1) or stopped (-1) computing at t. On a shared host that changes
        other computing workers' speeds: prefill passes are rescheduled from the work they
        have left, decode segments end at their next step boundary (and go on at the new
        speed from there)."""
        self.computing += change
        if self.c.host_cores <= 0:
            return
        if self.cores:
            by_load = range(len(self.cores))
            if change > 0:
                w.core = min(by_load, key=lambda c: len(self.cores[c]))
                self.cores[w.core].append(w)
            else:
                on = self.cores[w.core]
                del on[next(i for i, x in enumerate(on) if x is w)]  # by identity: workers compare by value
                w.core = -1
                # The idle balance: a core short by two takes the latest comer of the most
                # crowded one (with a queue per core, nothing else moves a running worker).
                while True:
                    most = max(by_load, key=lambda c: len(self.cores[c]))
                    least = min(by_load, key=lambda c: len(self.cores[c]))
                    if len(self.cores[most]) - len(self.cores[least]) < 2:
                        break
                    moved = self.cores[most].pop()
                    self.cores[least].append(moved)
                    moved.core = least
        self._respeed(t, w if change > 0 else None)

    def _background(self) -> float:
        """Cores of other work on the shared host now: the coordinator's and a load
        generator's (ClusterConfig.background_cores) and the side work of the passes running."""
        return self.c.background_cores + sum(x.side_cores for x in self.prefills if x.busy)

    def _respeed(self, t: float, starting: _Prefill | _Decode | None = None) -> None:
        """The shared host's speeds after a change at t (a worker started or stopped computing,
        a pass's side work changed): the background spread again, and every computing worker
        whose speed changed rescheduled. `starting`: a worker that starts computing at t."""
        if not self.cores:  # even: one speed for all; unchanged, nothing to reschedule
            slowdown = max(1.0, (self.computing + self._background()) / self.c.host_cores)
            if slowdown == self.even_slowdown:
                if starting is not None:
                    starting.slowdown = slowdown  # a pass about to be scheduled; a decode sets its own
                return
            self.even_slowdown = slowdown
        else:
            idle = sum(1 for c in self.cores if not c)
            self.spill = max(0.0, self._background() - idle) / len(self.cores)
        for p, x in enumerate(self.prefills):
            if not x.busy:
                continue
            slowdown = self._slowdown(x)
            if x.since < t and slowdown != x.slowdown:
                x.work_left = max(0.0, x.work_left - (t - x.since) / x.slowdown)
                x.since = t
            elif x.since < t:
                continue
            x.slowdown = slowdown  # a pass started at t: its end was scheduled at the old speed
            self._schedule_pass_end(p)
        for d, x in enumerate(self.decodes):
            if x.active and x.slowdown != self._slowdown(x):
                self.cut(d, t)

    def _slowdown(self, w: _Prefill | _Decode) -> float:
        """A computing worker's time over its profile's, now (module docstring)."""
        if self.c.host_cores <= 0:
            return 1.0
        if not self.cores:
            return self.even_slowdown
        return max(1.0, len(self.cores[w.core]) + self.spill)

    # -- decode workers -----------------------------------------------------------------------

    def kv_ready(self, t: float, d: int, event: tuple[_Req, int, int]) -> None:
        r, attempt, transfer = event
        if attempt != r.attempt or transfer != r.transfer:
            return  # it moved while its KV was landing, or a freeze held it
        w = self.decodes[d]
        if r.output_now == 1:  # the prefill's token was the last one
            r.finish_s = r.last_token_s
            self.free(t, d, r)
            return
        if w.frozen or self.prefills[r.prefill].frozen:
            since = max(x.frozen_at for x in (w, self.prefills[r.prefill]) if x.frozen)
            self._hold(r, since)
            return
        r.state = _State.WAITING
        w.waiting.append(r)
        if not w.active:
            self.boundary(t, d)
        elif w.running < self.c.max_batch:
            self.cut(d, t)

    def _steps_done(self, w: _Decode, t: float) -> int:
        """Steps of the running segment completed before t (< w.n: the segment's end event
        would have come first). A step ending exactly at t counts as lost."""
        lo, hi = 0, w.n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if w.t0 + self._steps_s(w, mid) < t:
                lo = mid
            else:
                hi = mid - 1
        return lo

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

    def _record_steps(self, w: _Decode, n: int) -> None:
        """Count n completed steps of the running segment: its token gaps and totals."""
        b = w.running
        w.step += n
        w.context_sum += n * b
        self.decode_steps += n
        self.decode_tokens += n * b
        if not n:
            return
        for r in w.joiners:  # their first decode token came at the end of step one
            self.itl.append((w.t0 + w.d0 - r.last_token_s, 1))
        j = len(w.joiners)
        if n * b > j:  # the other gaps: mean of the segment's steps, without the joiners' d0s
            self.itl.append(((b * self._steps_s(w, n) - j * w.d0) / (n * b - j), n * b - j))
        w.joiners = []

    def segment_end(self, t: float, d: int, version: int) -> None:
        w = self.decodes[d]
        if version != w.version:
            return
        self._record_steps(w, w.n)
        while w.finishes and w.finishes[0][0] <= w.step:
            _, _, r = heapq.heappop(w.finishes)
            r.finish_s = t
            w.running -= 1
            w.context_sum -= r.prompt + r.output
            self.free(t, d, r)
        w.active = False
        self.boundary(t, d, resumed=True)
        if not w.active:  # nothing left to run: this worker stopped computing
            self._computing(t, w, -1)

    def boundary(self, t: float, d: int, resumed: bool = False) -> None:
        """A step boundary: waiting requests join up to max_batch, then the next segment runs
        until the earliest finish (or until a landing request cuts it). resumed: right after
        the worker's previous segment (it has been computing), else from idle."""
        w = self.decodes[d]
        if w.frozen:
            return
        while w.waiting and w.running < self.c.max_batch:
            r = w.waiting.popleft()
            w.running += 1
            w.context_sum += r.prompt_now + 1  # its KV plus the latest token, fed back as input
            self.seq += 1
            r.state, r.join_step = _State.RUNNING, w.step
            heapq.heappush(w.finishes, (w.step + r.output_now - 1, self.seq, r))
            w.joiners.append(r)
        if not w.running:
            return
        if not resumed:  # counted before it is active: the rescale finds no segment of its own to cut
            self._computing(t, w, +1)
        w.active, w.t0 = True, t
        w.slowdown = self._slowdown(w)
        w.n = w.finishes[0][0] - w.step
        w.d0 = self.p.decode_step_s(w.running, w.context_sum) * w.slowdown
        w.version += 1
        self.push(t + self._steps_s(w, w.n), _SEG_END, d, w.version)

    def free(self, t: float, d: int, r: _Req) -> None:
        w = self.decodes[d]
        r.state = _State.DONE
        w.reserved -= r.blocks
        del w.placed[r]
        heapq.heappush(self.decode_heap, (w.reserved, d))
        if self.pending:
            self.admit(t)

    # -- failures -------------------------------------------------------------------------------

    def fail(self, t: float, role: str, i: int) -> None:
        """Worker i of role dies at t: what it held moves (module docstring)."""
        moved: list[_Req] = []
        if role == "decode":
            w = self.decodes[i]
            if not w.alive:
                return
            self._halt_decode(w, t)  # a frozen worker halted when it froze
            for _, _, r in w.finishes:
                r.done += 1 + w.step - r.join_step  # the prefill's token and its steps
            w.frozen = False
            for r in w.waiting:
                r.done += 1
            for r in w.placed:
                if r.state is _State.TRANSFER:
                    r.done += 1
                elif r.state is _State.PREFILL:
                    self._leave_prefill(r)
                moved.append(r)
            w.alive, w.reserved = False, 0
            w.placed, w.waiting, w.finishes, w.joiners = {}, deque(), [], []
            w.running = w.context_sum = 0
        else:
            w = self.prefills[i]
            if not w.alive:
                return
            w.frozen = False
            for d in self.decodes:
                for r in d.placed:
                    if r.prefill == i and r.state in (_State.PREFILL, _State.TRANSFER):
                        moved.append(r)
            for r in moved:
                if r.state is _State.TRANSFER:  # its first token came; its KV was still landing
                    r.done += 1
                dw = self.decodes[r.decode]
                dw.reserved -= r.blocks
                del dw.placed[r]
                heapq.heappush(self.decode_heap, (dw.reserved, r.decode))
            w.queue.clear()
            w.chunks, w.paused_pass = [], False
            w.queued_tokens = 0
            w.alive = False
            self._halt_prefill(w, t)
        # This death's moves go first, in arrival order, ahead of everything still queued (the
        # coordinator places a move at once; admission is for new requests). With no live
        # decode worker the coordinator has nowhere to place them: they fail.
        moved.sort(key=lambda r: r.arrival)
        no_decode = not any(w.alive for w in self.decodes)
        for r in reversed(moved):
            r.attempt += 1
            r.held = False
            r.first_chunk_s = -1.0
            if r.done >= r.output:  # its prefill's token was its last (its KV had not landed)
                r.state, r.finish_s = _State.DONE, r.last_token_s
                continue
            if r.attempt > self.c.max_migrations or no_decode:
                r.state = _State.FAILED
                continue
            r.state = _State.QUEUED
            self.pending.appendleft(r)
        self.admit(t)

    def _halt_decode(self, w: _Decode, t: float) -> None:
        """w stops stepping at t: the steps completed before t count (the clients have their
        tokens), the one in progress is lost."""
        if not w.active:
            return
        k = self._steps_done(w, t)
        joiners = set(map(id, w.joiners))  # before _record_steps clears them
        self._record_steps(w, k)
        for _, _, r in w.finishes:
            # Its latest token: the last completed step's. With none completed, a joiner (a
            # thaw makes every running request one) still has its token from before t0.
            if w.step > r.join_step and (k or id(r) not in joiners):
                r.last_token_s = w.t0 + self._steps_s(w, k)
        w.active = False
        w.version += 1  # its end event is stale
        self._computing(t, w, -1)

    def _halt_prefill(self, w: _Prefill, t: float) -> None:
        """w's pass in progress stops at t, unfinished (its end event is stale)."""
        w.version += 1
        if w.busy:
            w.busy = False
            self.busy_s += t - w.pass_start
            self._computing(t, w, -1)

    def _hold(self, r: _Req, since: float) -> None:
        """r's KV, its pass done, stops landing at `since` (a freeze of either end): it stays
        in TRANSFER, a death noticed moves it, and a thaw lands it once what its transfer had
        not moved by `since` has (nothing moves while an end is frozen: the receiver grants
        and acks, the sender writes). Bytes moved by x: bandwidth x (x - first chunk)."""
        if r.held:
            return
        total = r.prompt_now * self.p.kv_bytes_per_token
        moved = min(total, max(0.0, since - r.first_chunk_s) * self.p.transfer_bytes_per_s)
        left = (total - moved) / self.p.transfer_bytes_per_s + self.p.transfer_latency_s
        r.held = True
        r.transfer += 1  # a pending KV_READY is stale
        self.held.append((r, r.attempt, left))

    def freeze(self, t: float, role: str, i: int) -> None:
        """Worker i of role freezes at t: it computes and sends nothing more, but the
        coordinator still counts it alive and places requests on it until fail() notices or
        thaw() resumes it. A prefill pass keeps the work it has left (fail() drops it)."""
        if role == "decode":
            w = self.decodes[i]
            if w.alive:
                self._halt_decode(w, t)
                w.frozen, w.frozen_at = True, t
                for r in w.placed:
                    if r.state is _State.TRANSFER:
                        self._hold(r, t)
        else:
            w = self.prefills[i]
            if w.alive:
                if w.busy:
                    w.work_left = max(0.0, w.work_left - (t - w.since) / w.slowdown)
                    w.paused_pass = True
                self._halt_prefill(w, t)
                w.frozen, w.frozen_at = True, t
                for d in self.decodes:
                    for r in d.placed:
                        if r.prefill == i and r.state is _State.TRANSFER:
                            self._hold(r, t)

    def thaw(self, t: float, role: str, i: int) -> None:
        """Worker i of role, frozen, resumes at t before anyone declared it dead (module
        docstring): its pass or batch goes on, and the KV held by its freeze lands."""
        if role == "decode":
            w = self.decodes[i]
            if not (w.alive and w.frozen):
                return
            w.frozen = False
            # Every running request's next token is its first since the freeze: each gap
            # across it is recorded on its own, as a joiner's first gap is.
            seen = set(map(id, w.joiners))
            w.joiners += [r for _, _, r in sorted(w.finishes, key=lambda e: e[:2]) if id(r) not in seen]
            # The KV streaming to it from passes still running stood still meanwhile.
            for r in w.placed:
                if r.state is _State.PREFILL and r.first_chunk_s >= 0:
                    r.first_chunk_s += t - w.frozen_at
            self.boundary(t, i)
            self._release_held(t)
        else:
            w = self.prefills[i]
            if not (w.alive and w.frozen):
                return
            w.frozen = False
            # The KV its passes stream stood still while it was frozen (a request in the paused
            # pass is also at the head of the queue: shifted once).
            for r in {id(r): r for r in (*w.queue, *(r for r, _, _ in w.chunks))}.values():
                if r.prefill == i and r.first_chunk_s >= 0:
                    r.first_chunk_s += t - w.frozen_at
            if w.paused_pass:
                w.paused_pass = False
                w.since = w.pass_start = t
                w.busy = True
                self._computing(t, w, +1)
                self._schedule_pass_end(i)
            elif w.queue:
                self.start_pass(t, i)
            self._release_held(t)

    def _release_held(self, t: float) -> None:
        """A thaw at t: each held KV whose two ends are both thawed lands after what was left
        of its transfer; a death made the others' moves (their attempt is newer)."""
        held, self.held = self.held, []
        for r, attempt, left in held:
            if attempt != r.attempt:
                continue  # moved by a death meanwhile
            if self.decodes[r.decode].frozen or self.prefills[r.prefill].frozen:
                self.held.append((r, attempt, left))
                continue
            r.held = False
            self.push(t + left, _KV_READY, r.decode, (r, r.attempt, r.transfer))

    def _leave_prefill(self, r: _Req) -> None:
        """r leaves its (live) prefill worker's queue; a pass computing it runs on as waste."""
        w = self.prefills[r.prefill]
        w.queue.remove(r)
        w.queued_tokens -= r.remaining
        heapq.heappush(self.prefill_heap, (w.queued_tokens, r.prefill))

    def restart(self, t: float, role: str, i: int) -> None:
        """Worker i comes back empty (its queue, KV pool and batch start anew)."""
        if role == "decode":
            w = self.decodes[i]
            if w.alive:
                return
            w.alive = True
            heapq.heappush(self.decode_heap, (0, i))
        else:
            w = self.prefills[i]
            if w.alive:
                return
            w.alive = True
            heapq.heappush(self.prefill_heap, (0, i))
        self.admit(t)


def simulate(trace: list[Request], profile: CostProfile, config: ClusterConfig,
             slo: SLO | None = None) -> SimResult:
    return Simulator(profile, config).run(trace, slo)
