"""The planner's simulator against real runs of tandem on this host.

    python -m benchmarks.validate_plan --profile PROFILE.json [--model smollm2] [--runs ...]

Each run starts a local disaggregated cluster (benchmarks.bench_modes' topology: deploy.local,
one torch thread per worker and no core lease, prefill w8a8 and decode int4 as the profile
measured them, every prompt prefilled on a prefill worker: prefill_threshold 0, since the
simulator does not model conditional disaggregation), sends an open-loop Poisson load of chat prompts
(random words) streaming --output tokens each, and records every request's arrival, TTFT,
token times and prompt_eval_count. The same requests (arrival, prompt tokens, output tokens)
are then simulated with the profile on the same P:D, token budget and batch cap, and the
table prints measured and simulated TTFT and TPOT p50/p99 with their ratio (sim/measured).

Before each run's load, SOLO_REQUESTS chats are served one at a time and set against the
profile's simulation of each alone (measured / simulated, medians: the "solo" columns): how
fast the host runs now against when the profile was measured. The host's speed drifts (up to
~1.5x within minutes on the shared VMs of this project), and a run whose solo ratio is well
above 1 is one the profile under-predicts whatever the simulator does with queues and
batches. The "calibrated" rows take that out of the verdict the way profile_host measures a
profile's serving overheads: from these solo requests, on the run's own cluster just before
its load (not tens of minutes before, as the profile may be), the prefill pass's, the
coordinator's and the decode step's overheads are measured again over the profile's engine
costs (serving_overheads); what is left between those rows and the measurement is the
simulator's (queues, batches, shared cores).

A run is "P:D:RATE:REQUESTS", e.g. 1:1:0.4:24. The profile was measured with a core to
itself, while here the workers, the coordinator and the load generator share the host's
cores, so each run is simulated three times: "own" (a core per worker, as a planned cluster
would have), "shared" (the simulator's shared host: the cores this process may use, with
the coordinator's and the load generator's CPU time over the load, measured from /proc, as
background work, each core shared by the workers on its run queue; planner/simulator.py)
and "even" (the same host by processor sharing, every computing worker slowed alike), and
a fourth, "calibrated" (shared, with the overheads measured again, above).

--save FILE writes the measured runs (each request's arrival, prompt and output tokens, the
measured figures, the background and the solo requests); --replay FILE simulates them again
without a cluster, with any profile, so two simulators or profiles are compared on the same
measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.bench_modes import WORDS, Sample, mode_topology, serving, stream, warm_up
from common.processes import cpu_seconds, host_steal_seconds
from planner.cost_profile import CostProfile
from planner.metrics import RequestTimes, percentile
from planner.simulator import ClusterConfig, simulate
from planner.trace import Request

BUDGET, MAX_BATCH = 512, 64  # the cluster's --chunk-size and --max-num-seqs, simulated alike
SOLO_REQUESTS = 6  # per run, before its load: the host's speed against the profile's


def served_topology(name: str, model: str, model_path: Path, log_dir: Path, prefill: int, decode: int,
                    prefill_format: str = "w8a8", decode_format: str = "int4", threads: int = 1):
    """A local cluster as the simulator sees one: P prefill and D decode workers of `threads`
    threads each, no core lease, every prompt on a prefill worker (prefill_threshold 0)."""
    opts = argparse.Namespace(device="cpu", no_cuda_graphs=True)
    return mode_topology(name, model, model_path, log_dir, threads, opts, prefill=prefill, decode=decode,
                         chunk_size=BUDGET, prefill_threshold=0,
                         core_lease=False,  # a thread per worker, as the profile and the simulator
                         worker_args=("--kv-cache-gb", "0.5", "--prefill-quant", prefill_format,
                                      "--decode-quant", decode_format, "--max-num-seqs", str(MAX_BATCH)))


def solo_requests(url: str, model: str, profile: CostProfile, count: int,
                  rng: random.Random) -> list[tuple[Sample, RequestTimes]]:
    """`count` chats of 40..300 words and 32 tokens, sent one at a time (no queue, no batch),
    each with the profile's simulation of it alone on a 1:1 cluster."""
    pairs = []
    for _ in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 300)))
        s = stream(url, model, words, 32, "short")
        if s is None or s.tokens < 2:
            continue
        pairs.append((s, alone(s, profile)))
    return pairs


def alone(sample: Sample, profile: CostProfile) -> RequestTimes:
    """The profile's simulation of a measured request served alone on a 1:1 cluster."""
    return simulate([Request(0.0, sample.prompt_tokens or 1, sample.tokens)], profile,
                    ClusterConfig(1, 1, BUDGET, MAX_BATCH)).times[0]


@dataclass(frozen=True)
class ServingOverheads:
    """What serving adds to the engine's costs (CostProfile's serving fields), in seconds."""
    coordinator_s: float   # arrival -> the request at the workers, and its first token's way back
    prefill_pass_s: float  # a served prefill pass beyond the engine's
    decode_step_s: float   # a served decode step beyond the engine's
    requests: int          # the requests they were measured on

    def applied_to(self, profile: CostProfile) -> CostProfile:
        return replace(profile, coordinator_overhead_s=self.coordinator_s,
                       prefill_pass_overhead_s=self.prefill_pass_s, decode_step_overhead_s=self.decode_step_s)


def serving_overheads(engine: CostProfile, samples: list[Sample]) -> ServingOverheads:
    """Serving's overheads on top of `engine`'s costs (its own serving fields are ignored),
    from requests served one at a time, as medians over them: first the prefill pass's, the
    prefill worker's own time for the request (it reports it: tandem.prefill_worker_s) minus
    the engine's passes of its prompt; then the coordinator's and the decode step's, measured
    TTFT and TPOT minus the simulation of the request alone with that pass overhead. Each is
    clamped at 0 (a profile that already costs more than serving took leaves nothing).
    ValueError when no request reported its prefill worker's time."""
    engine = ServingOverheads(0.0, 0.0, 0.0, 0).applied_to(engine)
    # Per pass: a prompt over the budget is prefilled in several (the solo chats here fit one).
    passes = [(s.prefill_worker_s - engine.prefill_alone_s(s.prompt_tokens or 1, BUDGET))
              / math.ceil((s.prompt_tokens or 1) / BUDGET)
              for s in samples if s.prefill_worker_s is not None]
    if not passes:
        raise ValueError("no served request reported its prefill worker's time (tandem.prefill_worker_s)")
    pass_s = max(0.0, statistics.median(passes))
    served = replace(engine, prefill_pass_overhead_s=pass_s)
    sims = [alone(s, served) for s in samples]
    ttft = [s.ttft - sim.ttft_s for s, sim in zip(samples, sims)]
    tpot = [sum(s.itls) / len(s.itls) - sim.tpot_s for s, sim in zip(samples, sims)]
    return ServingOverheads(max(0.0, statistics.median(ttft)), pass_s, max(0.0, statistics.median(tpot)),
                            len(samples))


def solo_ratios(pairs: list[tuple[Sample, RequestTimes]]) -> tuple[float, float]:
    """Medians of measured / simulated TTFT and TPOT over solo requests (nan: none; inf for
    a request the profile simulates as free)."""
    def ratio(measured: float, simulated: float) -> float:
        return measured / simulated if simulated > 0 else math.inf

    if not pairs:
        return math.nan, math.nan
    return (statistics.median(ratio(s.ttft, alone.ttft_s) for s, alone in pairs),
            statistics.median(ratio(sum(s.itls) / len(s.itls), alone.tpot_s) for s, alone in pairs))


def run_load(url: str, model: str, rate: float, count: int, output: int, seed: int):
    """Open loop: request i is sent at its Poisson arrival whatever the others are doing."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(count)]
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300))) for _ in range(count)]
    results: list = [None] * count
    start = time.perf_counter()

    def one(i: int, at: float) -> None:
        results[i] = (at, stream(url, model, prompts[i], output, "short"))

    threads, at = [], 0.0
    for i, gap in enumerate(gaps):
        at += gap
        time.sleep(max(0.0, start + at - time.perf_counter()))
        t = threading.Thread(target=one, args=(i, time.perf_counter() - start))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [(at, s) for at, s in results if s is not None and s.tokens >= 1]


def figures(times: list[RequestTimes]) -> dict[str, float]:
    tpot = [v for t in times if (v := t.tpot_s) is not None]
    ttft = [t.ttft_s for t in times]
    return {"TTFT p50": percentile(ttft, 50), "TTFT p99": percentile(ttft, 99),
            "TPOT p50": percentile(tpot, 50), "TPOT p99": percentile(tpot, 99)}


@dataclass(frozen=True)
class Run:
    """One measured run, all the simulator needs to replay it (--save, --replay)."""
    spec: str                      # P:D:RATE:REQUESTS
    cores: int                     # the cores this process could use
    background: float              # coordinator + load generator CPU, cores, over the load
    # Per answered request: arrival s, prompt tokens, output tokens, TTFT s, its token gaps s.
    requests: list[tuple[float, int, int, float, list[float]]]
    load: tuple[float, float]      # 1-min load average before and after the load
    solo: tuple[float, float]      # measured / simulated TTFT and TPOT served alone
    steal_s: float
    # The requests served alone just before the load (measured), for the `calibrated`
    # simulation; empty in files saved before they were kept.
    solos: list[Sample] = field(default_factory=list)

    @property
    def trace(self) -> list[Request]:
        return [Request(at, prompt, output) for at, prompt, output, _, _ in self.requests]

    @property
    def measured(self) -> dict[str, float]:
        return figures([RequestTimes(at, at + ttft, at + ttft + sum(itls), output)
                        for at, _, output, ttft, itls in self.requests])

    @property
    def longest_gap_s(self) -> float:
        return max((g for *_, itls in self.requests for g in itls), default=math.nan)


def calibrated(run: Run, profile: CostProfile) -> CostProfile | None:
    """The profile with its serving overheads measured again from the run's requests served
    alone just before its load, on its own cluster (serving_overheads): what the host's drift
    since the profile was measured moved, as the overheads can carry it (the engine's costs
    stay the profile's). None when the run kept no such requests, or none that reported
    its prefill worker's time."""
    try:
        return serving_overheads(profile, run.solos).applied_to(profile) if run.solos else None
    except ValueError:
        return None


def simulated(run: Run, profile: CostProfile) -> dict[str, dict[str, float]]:
    """The run's figures as the simulator predicts them: "own" a core per worker; "shared"
    the host's cores shared per core, as Linux's run queues share them; "even" shared by
    processor sharing (planner/simulator.py, ClusterConfig.sharing); "calibrated" shared per
    core, with the serving overheads measured on the run's cluster (calibrated(); absent
    when it has none)."""
    prefill, decode = (int(x) for x in run.spec.split(":")[:2])
    trace = run.trace
    runs = {"own": (profile, ClusterConfig(prefill, decode, BUDGET, MAX_BATCH))}
    shared = {sharing: ClusterConfig(prefill, decode, BUDGET, MAX_BATCH, host_cores=run.cores,
                                     background_cores=run.background, sharing=sharing)
              for sharing in ("per_core", "even")}
    runs["shared"], runs["even"] = (profile, shared["per_core"]), (profile, shared["even"])
    if (recalibrated := calibrated(run, profile)) is not None:
        runs["calibrated"] = (recalibrated, shared["per_core"])
    return {name: figures(simulate(trace, p, config).times) for name, (p, config) in runs.items()}


def measure(spec: str, model: str, model_path: Path, log_dir: Path, profile: CostProfile,
            output: int, index: int) -> Run:
    prefill, decode, rate, count = spec.split(":")
    prefill, decode, rate, count = int(prefill), int(decode), float(rate), int(count)
    topology = served_topology(spec.replace(":", "_"), model, model_path, log_dir, prefill, decode)
    print(f"run {spec}: starting {prefill} prefill + {decode} decode workers ...", flush=True)
    cluster, url = serving(topology, model)
    with cluster:
        cluster.start()
        warm_up(url, model)
        load_before = os.getloadavg()[0]
        solos = solo_requests(url, model, profile, SOLO_REQUESTS, random.Random(100 + index))
        coordinator = next(c.process.pid for c in cluster.children if c.spec.name == "coordinator")
        # Background: the coordinator's CPU and this process's (the load generator).
        cpu_before = cpu_seconds(coordinator) + time.process_time()
        steal_before = host_steal_seconds()
        started = time.perf_counter()
        samples = run_load(url, model, rate, count, output, seed=index)
        background = ((cpu_seconds(coordinator) + time.process_time() - cpu_before)
                      / (time.perf_counter() - started))
        steal_after = host_steal_seconds()
        steal = steal_after - steal_before if None not in (steal_before, steal_after) else math.nan
        load_after = os.getloadavg()[0]
    return Run(spec, len(os.sched_getaffinity(0)), background,
               [(at, s.prompt_tokens or 1, s.tokens, s.ttft, list(s.itls)) for at, s in samples],
               (load_before, load_after), solo_ratios(solos), steal, [s for s, _ in solos])


def print_table(runs: list[Run], profile: CostProfile) -> None:
    print(f"\nprofile: {profile.source}; host cores: {', '.join(sorted({str(r.cores) for r in runs}))}")
    print("times in ms; ratio = simulated / measured; load = 1-min load average before/after the "
          "load; bg = coordinator + load generator CPU (cores) over the load; sim own: a core per "
          "worker, shared: the host's cores shared with bg, a run queue per core, even: the same "
          "cores by processor sharing, calibrated: shared with the serving overheads measured again "
          "from the solo requests; solo = measured / simulated TTFT and TPOT "
          f"of {SOLO_REQUESTS} requests served alone just before the load (above 1: the host runs "
          "slower than when profiled); steal = CPU ms the hypervisor took from the host's vCPUs "
          "during the load (/proc/stat), gap = the longest measured token gap, ms")
    print(f"{'P:D:rate:requests':18} {'done':>4} {'load':>9} {'bg':>4} {'solo':>9} {'steal':>5} "
          f"{'gap':>5} {'sim':>10}  " + "  ".join(
        f"{k + ' meas':>14} {'sim':>7} {'ratio':>5}" for k in ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")))
    for run in runs:
        meas = run.measured
        # Against this profile (a replayed run may have been measured with another).
        solo = solo_ratios([(s, alone(s, profile)) for s in run.solos]) if run.solos else run.solo
        for name, sim in simulated(run, profile).items():
            cells = "  ".join(f"{1e3 * meas[k]:14.1f} {1e3 * sim[k]:7.1f} {sim[k] / meas[k]:5.2f}"
                              for k in meas)
            print(f"{run.spec:18} {len(run.trace):4d} {run.load[0]:4.1f}/{run.load[1]:<4.1f} "
                  f"{run.background:4.2f} {solo[0]:4.2f}/{solo[1]:<4.2f} "
                  f"{1e3 * run.steal_s:5.0f} {1e3 * run.longest_gap_s:5.0f} {name:>10}  {cells}")


RUNS_SCHEMA = "tandem-validate-runs/1"


def save_runs(path: Path, runs: list[Run], profile: CostProfile) -> None:
    """Strict JSON: a figure that could not be measured (NaN: no /proc/stat, nothing served
    alone; inf: a solo request the profile simulates as free) is written as null, and read
    back as NaN."""
    def strict(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, (list, tuple)):
            return [strict(x) for x in v]
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        return v

    path.write_text(json.dumps({"schema": RUNS_SCHEMA, "profile": profile.source,
                                "runs": [strict(asdict(r)) for r in runs]}, allow_nan=False))


def load_runs(path: Path) -> list[Run]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise SystemExit(f"--replay {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--replay {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != RUNS_SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise SystemExit(f"{path}: not a --save file of validate_plan (schema {schema!r})")

    def num(v):
        return math.nan if v is None else v

    try:
        return [Run(**{**r, "load": tuple(map(num, r["load"])), "solo": tuple(map(num, r["solo"])),
                       "steal_s": num(r["steal_s"]),
                       "requests": [tuple(x) for x in r["requests"]],
                       "solos": [Sample(**x) for x in r.get("solos", [])]}) for r in data["runs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"--replay {path}: a run of an unknown shape ({exc!r})") from None


def main(argv: list[str] | None = None) -> None:
    from common.model_store import default_store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="cost profile (benchmarks.profile_host)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runs", nargs="+", default=["1:1:0.3:24", "1:1:0.8:36", "1:2:0.8:36"],
                   help="P:D:RATE:REQUESTS per run")
    p.add_argument("--output", type=int, default=32, help="num_predict of every request")
    p.add_argument("--save", type=Path, help="write the measured runs here (JSON), to --replay them")
    p.add_argument("--replay", type=Path,
                   help="simulate the runs a --save wrote (no cluster; --runs is ignored)")
    args = p.parse_args(argv)
    profile = CostProfile.load(args.profile)
    if args.replay:
        runs = load_runs(args.replay)
    else:
        model_path = default_store().resolve(args.model)
        runs = []
        with tempfile.TemporaryDirectory(prefix="tandem-validate-") as tmp:
            for i, spec in enumerate(args.runs):
                runs.append(measure(spec, args.model, model_path, Path(tmp), profile, args.output, i))
                if args.save:  # after each run: a later one failing loses none of them
                    save_runs(args.save, runs, profile)
    print_table(runs, profile)


if __name__ == "__main__":
    main()
