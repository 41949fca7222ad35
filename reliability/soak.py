"""The overload soak: `python -m reliability.soak [--duration 120] [--overload 4] [--out FILE]`.

Real processes (reliability/chaos_cluster.py: a coordinator, a prefill and a decode worker, small
admission limits so that capacity is small and known). First it measures capacity: requests/s
with as many closed-loop clients as the cluster has slots. Then it offers `overload` times that
rate, open loop, for `duration` seconds: a mix of normal clients, slow readers and clients that
disconnect mid-stream. Every `--sample` seconds it reads each process's VmRSS.

Must hold: shed requests get 503 with a Retry-After header; no process exits; every answer that
finishes is the reference text; RSS stays bounded (printed: first, peak and last per process,
after warm-up). Printed: requests/s offered, admitted and shed per window, and RSS over time.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from reliability.chaos_cluster import ChaosCluster, ChaosTopology, Stream
from reliability.chaos_scenarios import text_prompt

PROMPTS = 8  # distinct prompts (references computed once); lengths below
MIX = (("normal", 0.6), ("slow_reader", 0.2), ("disconnect", 0.2))


@dataclass
class SoakReport:
    capacity_rps: float = 0.0
    offered_rps: float = 0.0
    duration_s: float = 0.0
    outcomes: Counter = field(default_factory=Counter)  # kind -> count
    windows: list[dict] = field(default_factory=list)  # per window: t, offered, admitted, shed
    rss_mb: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name -> [(t, MB)]
    crashed: list[str] = field(default_factory=list)
    wrong: int = 0
    shed_without_retry_after: int = 0

    def rss_summary(self, warmup_s: float) -> dict[str, dict[str, float]]:
        out = {}
        for name, series in self.rss_mb.items():
            after = [mb for t, mb in series if t >= warmup_s] or [mb for _, mb in series]
            out[name] = {"first": after[0], "peak": max(after), "last": after[-1]}
        return out


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    def __init__(self, cluster: ChaosCluster, report: SoakReport, every_s: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.cluster, self.report, self.every_s, self.t0 = cluster, report, every_s, t0
        self.halt = threading.Event()

    def run(self) -> None:
        while True:
            now = time.monotonic() - self.t0
            for name, pid in self.cluster.pids().items():
                mb = rss_mb(pid)
                if mb is not None:
                    self.report.rss_mb.setdefault(name, []).append((round(now, 1), round(mb, 1)))
            if self.halt.wait(self.every_s):
                return


def measure_capacity(cluster: ChaosCluster, prompts, seconds: float) -> float:
    """Completed requests/s with one closed-loop client per slot."""
    slots = cluster.t.decode * cluster.t.max_running_per_worker
    done = Counter()
    end = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < end:
            content, n, _ = rng.choice(prompts)
            s = Stream(cluster.url, content, n)
            s.run()
            done["ok" if s.reply.done else "other"] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(slots)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done["ok"] / (time.monotonic() - start)


def soak(cluster: ChaosCluster, prompts, report: SoakReport, rate: float, duration_s: float,
         window_s: float, t0: float, out=print) -> None:
    rng = random.Random(1)
    lock = threading.Lock()
    window = Counter()
    active: list[threading.Thread] = []

    def one(kind: str, prompt) -> None:
        content, n, want = prompt
        s = Stream(cluster.url, content, n, timeout_s=120,
                   read_delay_s=0.05 if kind == "slow_reader" else 0.0,
                   disconnect_after=2 if kind == "disconnect" else None)
        s.run()
        r = s.reply
        with lock:
            if r.status == 503:
                window["shed"] += 1
                report.outcomes["shed_503"] += 1
                if not r.retry_after:
                    report.shed_without_retry_after += 1
                return
            if r.status == 200:
                window["admitted"] += 1
            if r.done:
                report.outcomes[f"{kind}_done"] += 1
                if r.text != want:
                    report.wrong += 1
            elif kind == "disconnect" and r.error == "client disconnected":
                report.outcomes["disconnected_mid_stream"] += 1
            else:
                report.outcomes[f"error_{r.status}"] += 1

    start = time.monotonic()
    next_window = start + window_s
    i = 0
    while (now := time.monotonic()) < start + duration_s:
        if now >= next_window:
            with lock:
                report.windows.append({"t": round(now - t0, 1), **{k: round(v / window_s, 2)
                                       for k, v in window.items()}})
                window.clear()
                w = report.windows[-1]
                out(f"t {w['t']:.0f} s: offered {w.get('offered', 0)}/s, admitted "
                    f"{w.get('admitted', 0)}/s, shed {w.get('shed', 0)}/s; wrong so far "
                    f"{report.wrong}")
            next_window += window_s
            for name in cluster.names():
                if cluster.process(name).poll() is not None and name not in report.crashed:
                    report.crashed.append(name)
        kind = rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
        t = threading.Thread(target=one, args=(kind, prompts[i % len(prompts)]), daemon=True)
        t.start()
        active.append(t)
        active = [t for t in active if t.is_alive()]
        with lock:
            window["offered"] += 1
        i += 1
        time.sleep(rng.expovariate(rate))  # Poisson arrivals
    for t in active:
        t.join(130)
    report.duration_s = time.monotonic() - start
    if window["offered"]:  # the last, partial window (its requests have ended by now)
        span = window_s - max(0.0, next_window - (start + duration_s))
        report.windows.append({"t": round(start + duration_s - t0, 1),
                               **{k: round(v / max(span, 1e-3), 2) for k, v in window.items()}})


def run(model_path: Path, log_dir: Path, duration_s: float, overload: float, sample_s: float = 2.0,
        window_s: float = 10.0, capacity_s: float = 10.0, out=print,
        secure: bool = False) -> SoakReport:
    from reliability.chaos import reference_texts

    expected = reference_texts(model_path)
    prompts = []
    for i in range(PROMPTS):
        content = text_prompt(20 + 40 * i, 1000 + i)
        n = 24 + 8 * (i % 4)
        prompts.append((content, n, expected(content, n)[0]))
    topology = ChaosTopology(model_path, log_dir, prefill=1, decode=1, max_running_per_worker=4,
                             max_queue=8, coordinator_args=("--queue-timeout", "5"),
                             secure=secure)
    report = SoakReport()
    with ChaosCluster(topology) as cluster:
        t0 = time.monotonic()
        sampler = Sampler(cluster, report, sample_s, t0)
        sampler.start()
        report.capacity_rps = measure_capacity(cluster, prompts, capacity_s)
        report.offered_rps = overload * report.capacity_rps
        out(f"capacity {report.capacity_rps:.1f} req/s; offering {report.offered_rps:.1f} req/s "
            f"for {duration_s:g} s")
        soak(cluster, prompts, report, report.offered_rps, duration_s, window_s, t0, out)
        sampler.halt.set()
        sampler.join()
        report.crashed += [n for n in cluster.names()
                           if cluster.process(n).poll() is not None and n not in report.crashed]
    return report


def figures(report: SoakReport, warmup_s: float) -> str:
    lines = [f"capacity (closed loop, all slots): {report.capacity_rps:.2f} req/s; offered "
             f"{report.offered_rps:.2f} req/s for {report.duration_s:.0f} s",
             "", "| t s | offered req/s | admitted req/s | shed 503 req/s |", "|---|---|---|---|"]
    for w in report.windows:
        lines.append(f"| {w['t']} | {w.get('offered', 0)} | {w.get('admitted', 0)} | {w.get('shed', 0)} |")
    lines += ["", "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items())),
              f"wrong answers: {report.wrong}; 503 without Retry-After: "
              f"{report.shed_without_retry_after}; crashed: {report.crashed or 'none'}", "",
              "| process | RSS MB after warm-up: first | peak | last |", "|---|---|---|---|"]
    for name, s in report.rss_summary(warmup_s).items():
        lines.append(f"| {name} | {s['first']:.0f} | {s['peak']:.0f} | {s['last']:.0f} |")
    names = list(report.rss_mb)
    lines += ["", "RSS MB over time: t | " + " | ".join(names)]
    series = {n: dict(report.rss_mb[n]) for n in names}
    times = sorted({t for n in names for t in series[n]})
    step = max(1, len(times) // 12)
    for t in times[::step] + ([times[-1]] if times and times[-1] not in times[::step] else []):
        lines.append(f"  {t:6.1f} | " + " | ".join(f"{series[n].get(t, float('nan')):.0f}" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reliability.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of overload")
    p.add_argument("--overload", type=float, default=4.0, help="offered load / measured capacity")
    p.add_argument("--model", default="tiny")
    p.add_argument("--sample", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--out", type=Path)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--secure", action="store_true", help="a cluster secret (proofs, CURVE) and "
                   "mutual TLS on the internal plane, as reliability.chaos --secure")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from reliability.chaos import resolve_model

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    model = resolve_model(args.model, work)
    report = run(model, work / "logs", args.duration, args.overload, args.sample,
                 secure=args.secure)
    print(figures(report, warmup_s=15.0))
    if args.out:
        outcomes, report.outcomes = report.outcomes, {}  # asdict would miscount a Counter
        args.out.write_text(json.dumps({**asdict(report), "outcomes": dict(outcomes),
                                        "rss_summary": report.rss_summary(15.0)}, indent=1))
        report.outcomes = outcomes
    healthy = (not report.crashed and report.wrong == 0 and report.shed_without_retry_after == 0
               and report.outcomes["shed_503"] > 0)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
