"""The fault-injection suite: `python -m reliability.chaos [--quick] [--model tiny|PATH] [--out FILE]`.

Runs real processes (a coordinator, 2 prefill and 2 decode workers, reliability/chaos_cluster.py)
and, one scenario at a time (reliability/chaos_scenarios.py): kill -9 of each role at each phase of a
request, KV link delay, loss, bandwidth cap, cut and stall, a frozen receiver, corrupted,
duplicated and late KV frames, a coordinator restart, and (on a cluster of its own with two
coordinators) a killed coordinator with a second one serving. After each scenario it restarts what
was killed (as `tandem serve`'s supervisor would), waits until every worker is registered and a
probe request is answered right, and checks every live worker's KV pool is full again.

Every reply is judged against the single-process engine's greedy text (chaos_cluster.Reply);
the table counts them, per fault. Must hold: wrong = 0, hung = 0, leaked = 0. `recover s`:
from the fault to the probe answered right with every worker registered.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from reliability import chaos_scenarios as sc
from reliability.chaos_cluster import ChaosCluster, ChaosTopology

CLIENT_TIMEOUT_S = 120.0  # a reply not finished by then is "hung"


@dataclass
class Row:
    scenario: str
    faults: int = 0
    phase_hit: bool | None = None
    affected: int = 0
    correct: int = 0
    clear_error: int = 0
    wrong: int = 0
    hung: int = 0
    leaked_blocks: int = 0  # summed over the processes that answered
    leaked_by_worker: dict = field(default_factory=dict)  # name -> blocks in use, None: not asked
    unasked: list[str] = field(default_factory=list)  # could not be asked: the check fails
    recover_s: float | None = None  # None: not recovered
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.wrong == 0 and self.hung == 0 and self.leaked_blocks == 0 and not self.unasked
                and self.recover_s is not None)

    @property
    def leaked_text(self) -> str:
        """The table's cell: a process that could not be asked is named, never counted as 0."""
        return str(self.leaked_blocks) + (f" + ? ({', '.join(self.unasked)} not asked)"
                                          if self.unasked else "")


def account_leaks(row: Row, by_worker: dict[str, int | None]) -> None:
    """The leak check's verdict from ChaosCluster.leaked_blocks: blocks in use on the processes
    that answered, and the names of those that could not be asked (None, or any negative
    count an older caller used for it), which fail the row (Row.ok) rather than count as 0.
    Nobody answering at all is unasked too: there is no pool to show empty."""
    row.leaked_by_worker = dict(by_worker)
    row.leaked_blocks = sum(n for n in by_worker.values() if n is not None and n >= 0)
    row.unasked = sorted(name for name, n in by_worker.items() if n is None or n < 0)
    if not by_worker:
        row.unasked = ["every worker (the coordinator listed none)"]


# Scenarios that act on the KV link proxy (chaos_cluster.py: zmq without the secure plane only).
LINK_FAULTS = ("KV link", "KV frame") + tuple(f"@ {p}" for p in sc.PROXY_PHASES)


def needs_link_proxy(name: str) -> bool:
    return any(part in name for part in LINK_FAULTS)


def scenarios(quick: bool) -> dict[str, Callable[[sc.Ctx], sc.Started]]:
    kills = {f"kill -9 {role} @ {phase}": (lambda ctx, r=role, p=phase: sc.kill_at(ctx, r, p))
             for role in sc.ROLES for phase in sc.PHASES}
    others = {
        "KV link delay 50 ms": lambda ctx: sc.link_condition(ctx, delay_s=0.05),
        "KV link loss 5% (TCP retransmits)": lambda ctx: sc.link_condition(ctx, loss=0.05),
        "KV link 2 MB/s": lambda ctx: sc.link_condition(ctx, rate_bps=2e6),
        "KV link cut 2 s mid-transfer": sc.link_cut,
        "KV link stalled 4 s mid-transfer": sc.link_stall,
        "decode frozen (SIGSTOP) 5 s": sc.receiver_frozen,
        "corrupted KV frame": lambda ctx: sc.frame_fault(ctx, "corrupt"),
        "duplicated KV frame": lambda ctx: sc.frame_fault(ctx, "duplicate"),
        "late KV frame (after release)": lambda ctx: sc.frame_fault(ctx, "late"),
        "coordinator restart": sc.coordinator_restart,
        "decode worker's link to the coordinator cut": sc.registry_link_cut,
        SECOND_COORDINATOR: sc.coordinator_killed_second_serving,
    }
    every = {**kills, **others}
    if not quick:
        return every
    return {name: every[name] for name in QUICK}


# Runs on a cluster of its own with two coordinators (ChaosTopology.coordinators), after the
# others, which keep the one-coordinator cluster they were measured on.
SECOND_COORDINATOR = "kill -9 coordinator, a second one serving"

QUICK = ("kill -9 decode @ decoding", "kill -9 prefill @ mid-prefill", "coordinator restart",
         "corrupted KV frame", "duplicated KV frame", "decode worker's link to the coordinator cut")


def run_one(ctx: sc.Ctx, name: str, scenario: Callable[[sc.Ctx], sc.Started],
            leak_wait_s: float) -> Row:
    c = ctx.cluster
    started = scenario(ctx)
    row = Row(name, faults=started.faults, phase_hit=started.phase_hit, notes=started.notes)
    streams = list(started.streams)
    _judge(row, streams)
    c.clear_faults()
    restarted = c.restart_dead()
    if restarted:
        row.notes.append(f"restarted {', '.join(restarted)}")
    if started.after is not None:
        _judge(row, started.after())
    row.recover_s = _recover(ctx, started.fault_at)
    account_leaks(row, c.leaked_blocks(leak_wait_s))
    return row


def _judge(row: Row, streams) -> None:
    for stream, want in streams:
        stream.join(CLIENT_TIMEOUT_S)
        verdict = stream.reply.verdict(want)
        row.affected += 1
        setattr(row, verdict, getattr(row, verdict) + 1)
        if verdict != "correct":
            why = stream.reply.error or ("stream cut" if stream.reply.cut else "")
            row.errors.append(f"{verdict}: {why}"[:300])


def _recover(ctx: sc.Ctx, fault_at: float, timeout_s: float = 120.0) -> float | None:
    """Seconds from the fault until every worker is registered and a probe is answered right."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ctx.cluster.wait_live(max(0.0, deadline - time.monotonic())):
            stream, want = ctx.request(60, 8)
            stream.join(60)
            if stream.reply.verdict(want) == "correct":
                return time.monotonic() - fault_at
        time.sleep(0.2)
    return None


def reference_texts(model_path: Path) -> Callable[[str, int], tuple[str, int]]:
    """(text, tokens) of a greedy chat request on the single-process engine, memoized."""
    from engine.generation import TextStream, chat_prompt_ids
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from common.sampling_params import SamplingParams

    reference = LLMEngine.from_path(model_path, EngineConfig(cache=CacheConfig(num_blocks=2048)))
    cache: dict[tuple[str, int], tuple[str, int]] = {}

    def expected(content: str, n: int) -> tuple[str, int]:
        """The reference text of a greedy request, and how many tokens it has."""
        if (content, n) not in cache:
            ids = chat_prompt_ids(reference, [{"role": "user", "content": content}])
            stream = TextStream(reference, ids, SamplingParams(temperature=0.0, num_predict=n))
            cache[content, n] = "".join(stream), len(stream.token_ids)
        return cache[content, n]

    return expected


def run(model_path: Path, log_dir: Path, quick: bool = False, only: tuple[str, ...] = (),
        out: Callable[[str], None] = print, kv_backend: str = "zmq",
        secure: bool = False) -> list[Row]:
    expected = reference_texts(model_path)
    topology = ChaosTopology(model_path, log_dir, kv_backend=kv_backend, secure=secure)
    chosen = scenarios(quick)
    if only:
        chosen = {k: v for k, v in scenarios(False).items() if any(o in k for o in only)}
    if not topology.link_proxies:
        left_out = [k for k in chosen if needs_link_proxy(k)]
        chosen = {k: v for k, v in chosen.items() if not needs_link_proxy(k)}
        if left_out:
            out(f"left out (they act on the zmq link proxy, which stands only on plain zmq): "
                f"{', '.join(left_out)}")
    rows = []
    groups = [(topology, {k: v for k, v in chosen.items() if k != SECOND_COORDINATOR}),
              (replace(topology, coordinators=2, log_dir=log_dir / "two-coordinators"),
               {k: v for k, v in chosen.items() if k == SECOND_COORDINATOR})]
    for t, group in groups:
        if not group:
            continue
        with ChaosCluster(t) as cluster:
            ctx = sc.Ctx(cluster, expected)
            for name, scenario in group.items():
                row = run_one(ctx, name, scenario, leak_wait_s=t.kv_deadline_s + 15)
                out(f"{'ok  ' if row.ok else 'FAIL'} {name}: {row.correct}/{row.affected} correct, "
                    f"{row.clear_error} clear errors, {row.wrong} wrong, {row.hung} hung, "
                    f"{row.leaked_text} leaked, recovered in {_fmt(row.recover_s)} s"
                    + (f"  [{'; '.join(row.notes)}]" if row.notes else ""))
                rows.append(row)
    return rows


def _fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}"


def table(rows: list[Row]) -> str:
    head = ("| fault injected | n | phase hit | affected | correct | clear error | wrong | hung "
            "| leaked KV blocks | recover s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        hit = "" if r.phase_hit is None else ("yes" if r.phase_hit else "no")
        lines.append(f"| {r.scenario} | {r.faults} | {hit} | {r.affected} | {r.correct} | "
                     f"{r.clear_error} | {r.wrong} | {r.hung} | {r.leaked_text} | {_fmt(r.recover_s)} |")
    total = {k: sum(getattr(r, k) for r in rows)
             for k in ("faults", "affected", "correct", "clear_error", "wrong", "hung", "leaked_blocks")}
    worst = max((r.recover_s for r in rows if r.recover_s is not None), default=None)
    lines.append(f"| **total** | {total['faults']} | | {total['affected']} | {total['correct']} | "
                 f"{total['clear_error']} | {total['wrong']} | {total['hung']} | "
                 f"{total['leaked_blocks']}{' + ?' if any(r.unasked for r in rows) else ''} | "
                 f"max {_fmt(worst)} |")
    return "\n".join(lines)


def resolve_model(name: str, work: Path) -> Path:
    if name == "tiny":
        return tiny_model(work)
    from common.model_store import default_store

    return default_store().resolve(name)


def tiny_model(root: Path) -> Path:
    """A small random llama (the tests' model factory): fast, and big enough that a prefill of
    a few thousand tokens lasts long enough to land a kill inside it."""
    from reliability.model_factory import make_tiny_hf_model

    path = root / "chaos-model"
    if not (path / "config.json").exists():
        make_tiny_hf_model(path, "llama", hidden=256, layers=4, heads=4, kv_heads=2,
                           intermediate=512, max_position=4096)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reliability.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only: {', '.join(QUICK)}")
    p.add_argument("--only", action="append", default=[], help="scenarios whose name contains this")
    p.add_argument("--model", default="tiny", help="'tiny' (a random model made here) or a model "
                   "directory/name the workers can load")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--work-dir", type=Path, help="model and logs (default: a temporary directory)")
    p.add_argument("--kv-backend", default="zmq", choices=("zmq", "shm", "grpc", "dist"),
                   help="the workers' KV transfer backend (default zmq)")
    p.add_argument("--secure", action="store_true",
                   help="a cluster secret (call proofs, KV keys, CURVE on zmq) and mutual TLS on "
                        "the internal gRPC plane, from a CA made for the run")
    args = p.parse_args(argv)
    # SIGTERM (a timeout, Ctrl-C from a supervisor) unwinds like Ctrl-C: every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    model = resolve_model(args.model, work)
    started = time.monotonic()
    rows = run(model, work / "logs", quick=args.quick, only=tuple(args.only),
               kv_backend=args.kv_backend, secure=args.secure)
    plane = f"{args.kv_backend}{', secret + mutual TLS' if args.secure else ''}"
    print(f"\n{plane}\n{table(rows)}\n\n{len(rows)} scenarios in {time.monotonic() - started:.0f} s; logs in {work / 'logs'}")
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
