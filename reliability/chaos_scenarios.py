"""The chaos suite's scenarios: each starts requests, injects one fault at a chosen point of
their life, and returns what it started; reliability/chaos.py judges the replies, restarts what was
killed, and measures recovery and leaks.

Phases of a request, and how each is reached without a hook in the product (markers come from
the KV link proxy and the coordinator's own counters, so a kill lands inside the phase):

    queued       the cluster's slots are full of blocker streams; the victim waits in the
                 coordinator's admission queue (tandem_queue_depth >= 1)
    reserving    the KV links are stalled; the decode worker has reserved blocks and the
                 prefill worker's grant request has reached the link (proxy: a G message read)
    mid-prefill  the first KV unit of the victim reached the link, no first token yet
    kv-landing   the links are slowed; the prefill has answered (the client has its first
                 token) while the KV is still crossing to the decode worker
    decoding     the KV link has carried the sender's finish: the decode worker generates

Without link proxies (another backend, or the secure plane, whose CURVE hides the markers:
chaos_cluster.py), the phases come from the coordinator's worker list: mid-prefill is a prefill
worker busy with the victim's prompt (the coordinator's own assignment) that has not answered,
decoding is a decode worker's completed-transfer count grown (heartbeats carry it). Reserving and kv-landing need a
stalled or slowed link, so they run only with the proxies (PROXY_PHASES).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.config import CoordinatorConfig
from reliability.chaos_cluster import ChaosCluster, Stream

WORDS = "the of and to in is was for on that with as by it at from his an were are which this".split()
PHASES = ("queued", "reserving", "mid-prefill", "kv-landing", "decoding")
PROXY_PHASES = ("reserving", "kv-landing")  # reached only by stalling or slowing the link
ROLES = ("coordinator", "prefill", "decode")


def text_prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Started:
    """What a scenario did: streams with their expected texts, when its fault hit, and
    whether the kill landed in the phase it aimed at (None: not a phase scenario)."""

    streams: list[tuple[Stream, str]] = field(default_factory=list)
    faults: int = 0
    fault_at: float = 0.0
    phase_hit: bool | None = None
    notes: list[str] = field(default_factory=list)
    after: Callable[[], list[tuple[Stream, str]]] | None = None  # more requests once it ends


@dataclass
class Ctx:
    cluster: ChaosCluster
    expected: Callable[[str, int], tuple[str, int]]  # reference (text, tokens) of (prompt, num_predict)
    seed: int = 0

    def prepare(self, words: int, num_predict: int, long: bool = False) -> tuple[str, int, str]:
        """(prompt, num_predict, reference text), computed before any stream starts. long: a
        prompt whose answer runs to at least 3/4 of num_predict (a random model may end early)
        with text early on, so that a fault can land mid-stream."""
        for _ in range(30):
            self.seed += 1
            content = text_prompt(words, self.seed)
            # long: a cheap look at the start first (greedy: it is the answer's prefix). It
            # must print early: the coordinator holds back bytes that are not yet whole UTF-8
            # characters, and a random model may emit such bytes for a long time.
            if long and len(self.expected(content, 60)[0].strip()) < 20:
                continue
            want, n_tokens = self.expected(content, num_predict)
            if not long or n_tokens >= num_predict * 3 // 4:
                return content, num_predict, want
        return content, num_predict, self.expected(content, num_predict)[0]

    def start(self, prepared: tuple[str, int, str], **kw) -> tuple[Stream, str]:
        content, num_predict, want = prepared
        return self.cluster.stream(content, num_predict, **kw), want

    def request(self, words: int, num_predict: int, long: bool = False, **kw) -> tuple[Stream, str]:
        return self.start(self.prepare(words, num_predict, long), **kw)


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


class Tracker(threading.Thread):
    """Polls the coordinator for the workers serving open requests, so that a scenario knows
    whom to kill (the prefill worker is busy only for a moment)."""

    def __init__(self, cluster: ChaosCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.prefill: str | None = None
        self.decode: str | None = None
        self.prefill_answered = threading.Event()  # a prefill seen busy is idle again
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.02):
            try:
                workers = self.cluster.workers()
            except OSError:
                continue
            busy = {w["worker_id"] for w in workers
                    if w["role"] == "prefill" and w.get("assigned_prefill_tokens")}
            if self.prefill is not None and self.prefill not in busy:
                self.prefill_answered.set()
            if busy:
                self.prefill = sorted(busy)[0]
            for w in workers:
                if w["role"] == "decode" and w["assigned_requests"]:
                    self.decode = w["worker_id"]


def arrived(cluster: ChaosCluster, kinds: bytes) -> dict[str, int]:
    return {name: sum(p.c2s.arrived[bytes([k])] for k in kinds) for name, p in cluster.proxies.items()}


def messages(cluster: ChaosCluster, kinds: bytes) -> dict[str, int]:
    """Messages of these kinds each KV link has forwarded."""
    return {name: sum(p.c2s.messages[bytes([k])] for k in kinds) for name, p in cluster.proxies.items()}


def transfers_done(cluster: ChaosCluster) -> dict[str, int]:
    """Transfers each decode worker has completed, as its last heartbeat reported."""
    return {w["worker_id"]: (w.get("kv") or {}).get("transfers_done", 0)
            for w in cluster.workers() if w["role"] == "decode"}


def landed(cluster: ChaosCluster) -> dict[str, int]:
    """Per decode worker, transfers whose sender's finish has crossed: the proxy's count of
    finish (C) messages, or without proxies the workers' completed-transfer counts."""
    return messages(cluster, b"C") if cluster.proxies else transfers_done(cluster)


def changed(before: dict[str, int], now: dict[str, int]) -> str | None:
    return next((name for name in now if now[name] > before.get(name, 0)), None)


# -- kill -9 a role at a phase ------------------------------------------------------------------

PROMPT_WORDS = 1500  # ~3,300 tokens: a prefill long enough to land a kill inside it
LONG_ANSWER = 1500  # tokens: a few seconds of decoding
# The coordinator's default heartbeat deadline, which the chaos cluster keeps.
DEFAULT_HEARTBEAT_DEADLINE_S = CoordinatorConfig().heartbeat_deadline_s
SLOW_LINK_BPS = 4e6  # kv-landing: 13 MB of KV takes ~3 s, the prefill under 1 s


def kill_at(ctx: Ctx, role: str, phase: str) -> Started:
    c = ctx.cluster
    out = Started(faults=1)
    tracker = Tracker(c)
    tracker.start()
    victim_decode: str | None = None
    try:
        if phase == "queued":
            slots = c.t.decode * c.t.max_running_per_worker
            blockers = [ctx.prepare(20, 800, long=True) for _ in range(slots)]
            victim_request = ctx.prepare(200, 40)
            out.streams = [ctx.start(b) for b in blockers]
            wait_until(lambda: sum(w["assigned_requests"] for w in c.workers()
                                   if w["role"] == "decode") >= slots, 30, 0.05)
            out.streams.append(ctx.start(victim_request))
            out.phase_hit = wait_until(lambda: (c.metric("tandem_queue_depth") or 0) >= 1, 10, 0.02)
            victim_decode = tracker.decode
        elif phase == "reserving":
            for p in c.proxies.values():
                p.set(stalled=True)
            before = arrived(c, b"GH")
            out.streams = [ctx.request(200, 40)]
            out.phase_hit = wait_until(lambda: changed(before, arrived(c, b"GH")) is not None, 20)
            victim_decode = changed(before, arrived(c, b"GH"))
            time.sleep(0.1)
        elif phase == "mid-prefill" and not c.proxies:
            out.streams = [ctx.request(PROMPT_WORDS, 40)]
            wait_until(lambda: tracker.prefill is not None, 30, 0.005)
            # Busy on the coordinator's own books (not a heartbeat's, which lag by up to an
            # interval): the prefill has not answered yet.
            out.phase_hit = (tracker.prefill is not None and not out.streams[0][0].reply.text
                             and not tracker.prefill_answered.is_set())
        elif phase == "mid-prefill":
            before = arrived(c, b"D")
            out.streams = [ctx.request(PROMPT_WORDS, 40)]
            wait_until(lambda: changed(before, arrived(c, b"D")) is not None, 30, 0.002)
            victim_decode = changed(before, arrived(c, b"D"))
            out.phase_hit = not out.streams[0][0].reply.text and not tracker.prefill_answered.is_set()
        elif phase == "kv-landing":
            for p in c.proxies.values():
                p.set(rate_bps=SLOW_LINK_BPS)
            out.streams = [ctx.request(PROMPT_WORDS, 40)]
            reply = out.streams[0][0].reply
            # The prefill has answered; the client sees its first token only with the second,
            # once the KV has landed and the decode worker runs.
            wait_until(lambda: tracker.prefill_answered.is_set() or reply.finished.is_set(), 60, 0.005)
            out.phase_hit = not reply.text and not reply.finished.is_set()
            victim_decode = tracker.decode
        elif phase == "decoding":
            prepared = ctx.prepare(100, LONG_ANSWER, long=True)
            before = landed(c)
            out.streams = [ctx.start(prepared)]
            reply = out.streams[0][0].reply
            # The sender's finish (C) has crossed: the decode worker holds all the KV and
            # generates. (The client's text is no marker: the coordinator holds back bytes
            # that are not yet whole UTF-8 characters, which a random model emits at length.)
            crossed = wait_until(lambda: changed(before, landed(c)) is not None, 60, 0.005)
            time.sleep(0.3)
            out.phase_hit = crossed and not reply.finished.is_set()
            victim_decode = tracker.decode
        victim = {"coordinator": "coordinator",
                  "prefill": tracker.prefill or "prefill-0",
                  "decode": victim_decode or tracker.decode or "decode-0"}[role]
        out.fault_at = time.monotonic()
        c.kill(victim)
        out.notes.append(f"killed {victim}")
        for p in c.proxies.values():
            p.set(stalled=False)
    finally:
        tracker.halt.set()
    return out


# -- the links and the receiver ------------------------------------------------------------------

def link_condition(ctx: Ctx, **faults) -> Started:
    """Requests over KV links with a standing condition (delay, loss, a bandwidth cap)."""
    out = Started(faults=1, fault_at=time.monotonic())
    hits = lambda: sum(sum(p.injected.values()) for p in ctx.cluster.proxies.values())  # noqa: E731
    before = hits()
    for p in ctx.cluster.proxies.values():
        p.set(**faults)
    out.streams = [ctx.request(words, 30) for words in (40, 400, 800)]
    for stream, _ in out.streams:
        stream.join(120)
    out.faults = max(1, hits() - before)  # lost-and-retransmitted chunks for `loss`
    return out


def _mid_transfer(ctx: Ctx) -> tuple[Started, str | None]:
    """Starts a long-prompt request; returns once its first KV unit reached a link."""
    c = ctx.cluster
    before = arrived(c, b"D")
    out = Started(faults=1)
    out.streams = [ctx.request(PROMPT_WORDS, 40)]
    wait_until(lambda: changed(before, arrived(c, b"D")) is not None, 30, 0.002)
    return out, changed(before, arrived(c, b"D"))


def link_cut(ctx: Ctx, seconds: float = 2.0) -> Started:
    """The KV link is cut (connections reset, new ones refused) mid-transfer, then restored."""
    for p in ctx.cluster.proxies.values():
        p.set(rate_bps=SLOW_LINK_BPS)  # the transfer is still crossing when the cut comes
    out, name = _mid_transfer(ctx)
    out.fault_at = time.monotonic()
    for p in ctx.cluster.proxies.values():
        p.set(down=True)
    time.sleep(seconds)
    for p in ctx.cluster.proxies.values():
        p.set(down=False, rate_bps=0.0)
    out.notes.append(f"cut the KV links for {seconds:g} s (request on {name})")
    return out


def link_stall(ctx: Ctx, seconds: float = 4.0) -> Started:
    """The KV link stops forwarding mid-transfer (a receiver that stops reading), then goes on."""
    for p in ctx.cluster.proxies.values():
        p.set(rate_bps=SLOW_LINK_BPS)
    out, name = _mid_transfer(ctx)
    out.fault_at = time.monotonic()
    for p in ctx.cluster.proxies.values():
        p.set(stalled=True)
    time.sleep(seconds)
    for p in ctx.cluster.proxies.values():
        p.set(stalled=False, rate_bps=0.0)
    out.notes.append(f"stalled the KV links for {seconds:g} s (request on {name})")
    return out


def registry_link_cut(ctx: Ctx, seconds: float = 8.0) -> Started:
    """The link from the decode worker serving a stream to the coordinator's Registry is cut
    (its heartbeats fail; the coordinator's own calls to it still pass) for longer than the
    coordinator waits for a heartbeat, then restored. The coordinator asks a silent worker
    for its Status before declaring it dead: this one answers, so it must keep its stream and
    its place, and a new request during the cut must be right too."""
    c = ctx.cluster
    tracker = Tracker(c)
    tracker.start()
    out = Started(faults=1)
    # Long enough to outlive the heartbeat deadline inside the cut on a fast host: the chaos
    # model decodes ~650 tokens/s on an AMD EPYC (Zen 4 class) VM, where LONG_ANSWER's 1500
    # ended ~4 s into the cut; 3500 fit its 4096-token context beside the prompt.
    prepared = ctx.prepare(100, 3500, long=True)
    during = ctx.prepare(60, 8)
    before = landed(c)
    out.streams = [ctx.start(prepared)]
    reply = out.streams[0][0].reply
    wait_until(lambda: changed(before, landed(c)) is not None, 60, 0.005)
    time.sleep(0.3)  # decoding (see kill_at's decoding phase)
    victim = tracker.decode or "decode-0"
    tracker.halt.set()
    out.fault_at = time.monotonic()
    c.cut_registry_link(victim, True)
    # The stream outlived the coordinator's heartbeat deadline (heartbeat_misses intervals, 3 s
    # by default, from the last heartbeat before the cut) inside the cut: checked just past it,
    # not at the cut's end, which a fast host's stream may not reach.
    check_s = min(seconds, DEFAULT_HEARTBEAT_DEADLINE_S + 0.3)
    time.sleep(check_s)
    out.phase_hit = not reply.finished.is_set()
    out.streams.append(ctx.start(during))
    time.sleep(seconds - check_s)
    kept = [w["alive"] for w in c.workers() if w["worker_id"] == victim]
    c.cut_registry_link(victim, False)
    out.notes.append(f"cut {victim}'s Registry link for {seconds:g} s; "
                     f"{'still live' if kept == [True] else 'declared dead'} at its end")
    return out


def receiver_frozen(ctx: Ctx, seconds: float = 5.0) -> Started:
    """SIGSTOP the decode worker serving a stream (its heartbeats stop too), then SIGCONT."""
    c = ctx.cluster
    tracker = Tracker(c)
    tracker.start()
    out = Started(faults=1)
    prepared = ctx.prepare(100, LONG_ANSWER, long=True)
    before = landed(c)
    out.streams = [ctx.start(prepared)]
    wait_until(lambda: changed(before, landed(c)) is not None, 60, 0.005)
    time.sleep(0.3)  # decoding (see kill_at's decoding phase)
    victim = tracker.decode or "decode-0"
    tracker.halt.set()
    out.fault_at = time.monotonic()
    c.kill(victim, signal.SIGSTOP)
    time.sleep(seconds)
    c.kill(victim, signal.SIGCONT)
    out.notes.append(f"froze {victim} for {seconds:g} s")
    return out


def frame_fault(ctx: Ctx, what: str) -> Started:
    """One KV data frame of a request corrupted, duplicated, or delivered again late (after
    the request ended and its blocks went back to the pool and the prefix cache)."""
    c = ctx.cluster
    for p in c.proxies.values():
        if what == "corrupt":
            p.corrupt(b"D")
        else:
            p.replay(b"D", 0.0 if what == "duplicate" else 2.0)
    out = Started(fault_at=time.monotonic())
    out.streams = [ctx.request(200, 30)]
    out.streams[0][0].join(120)
    out.faults = sum(p.injected[{"corrupt": "corrupt"}.get(what, "replay")] for p in c.proxies.values())
    for p in c.proxies.values():
        p.clear()  # the one-shot armed on the link the request did not take
    if what == "late":
        time.sleep(2.5)  # the late copy lands after the request ended
        stream, want = out.streams[0]

        def again() -> list[tuple[Stream, str]]:
            # The same prompt again: a decode worker serves it from its prefix cache, which a
            # late frame written into a freed block would have poisoned.
            return [(c.stream(stream.content, 30), want), ctx.request(200, 30)]

        out.after = again
    return out


def coordinator_restart(ctx: Ctx) -> Started:
    """kill -9 the coordinator with streams open; a new one on the same ports; the workers
    re-register by themselves."""
    out = Started(faults=1)
    prepared = [ctx.prepare(100, LONG_ANSWER, long=True) for _ in range(3)]
    before = landed(ctx.cluster)
    out.streams = [ctx.start(p) for p in prepared]
    wait_until(lambda: sum(landed(ctx.cluster).values()) - sum(before.values()) >= 3, 60, 0.01)
    time.sleep(0.3)  # all three decoding (see kill_at's decoding phase)
    out.fault_at = time.monotonic()
    ctx.cluster.kill("coordinator")
    return out


def coordinator_killed_second_serving(ctx: Ctx, answer: int = 300) -> Started:
    """Two coordinators (ChaosTopology.coordinators = 2) over the same workers: streams open
    on both, kill -9 the first. Its streams end with a clear error (nothing outlives it); the
    second's streams go on to the right answer, and so do new requests to it while the first
    is down; the workers free the orphaned requests' blocks (the leak check). `answer`: the
    open streams' length in tokens (each costs the reference engine its text first)."""
    c = ctx.cluster
    if len(c.urls) < 2:
        raise ValueError("this scenario needs a second coordinator (ChaosTopology.coordinators=2)")
    second = c.urls[1]
    out = Started(faults=1)
    prepared = [ctx.prepare(100, answer, long=True) for _ in range(2)]
    fresh = [ctx.prepare(60, 30) for _ in range(2)]  # reference texts before the fault
    before = landed(c)
    out.streams = [ctx.start(prepared[0]), ctx.start(prepared[1], url=second)]
    wait_until(lambda: sum(landed(c).values()) - sum(before.values()) >= 2, 60, 0.01)
    time.sleep(0.3)  # both decoding (see kill_at's decoding phase)
    first = out.streams[0][0].reply
    out.phase_hit = not first.finished.is_set()  # the kill lands in an open stream
    out.fault_at = time.monotonic()
    c.kill("coordinator")
    out.notes.append("killed coordinator; coordinator-1 serving")
    # Started now, while the first coordinator is dead; judged once the suite restarted it.
    while_down = [ctx.start(p, url=second) for p in fresh]
    out.after = lambda: while_down
    return out
