"""Disaggregated vs colocated serving under one mixed load, in one run.

    python -m benchmarks.bench_modes [--model smollm2] [--duration 30] [--chat-clients 4]
                                 [--long-every 3.0] [--long-words 1100] [--skip-transfer]

Three topologies of the same model on this host, each started with deploy.local, loaded the
same way, stopped:
  disaggregated        1 prefill + 1 decode worker, KV over zmq, chunked prefill (256);
                       prompts of <= 128 tokens are prefilled on the decode worker, in
                       chunks of 64 (the coordinator's default local chunk)
  colocated-chunked    1 worker doing both, token budget 256 per pass (split-fuse)
  colocated-unchunked  1 worker doing both, budget 4096: a long prompt is one pass
Load: --chat-clients closed-loop clients, each streaming short chat turns (num_predict 48),
plus one long prompt (~--long-words words) every --long-every seconds. Reported per mode:
ITL p50/p99 of the short streams (what a long prefill stalls), TTFT p50/p99 of short and of
long requests, and output tokens/s. Then KV transfer throughput per backend next to a memory
copy (benchmarks.bench_kvtransfer). Every mode gets the same cores: the disaggregated pair is two engine
processes of --threads-per-worker torch threads each, a colocated worker one process of twice
that many, so the comparison measures the design, not the core count. The figures say what
this machine does, not a GPU cluster.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local import LocalCluster
from deploy.process_plan import free_port, plan
from deploy.local_topology import Topology

WORDS = ("the of and to in is was for on that with as by it at from his an were are which this "
         "be or has had not but what all when can there been one its who new more about").split()

# chunk_size: every worker's per-pass token budget. The coordinator's chunk plan sends local
# prefills (all of a colocated worker's) in chunks of --local-chunk-size: set per mode so the
# colocated baselines chunk at 256 and not at all.
# workers: engine processes of the mode (threads are shared out so every mode uses the same cores).
MODES = {
    "disaggregated": dict(prefill=1, decode=1, chunk_size=256),
    "colocated-chunked": dict(colocated=True, chunk_size=256, coordinator_args=("--local-chunk-size", "256")),
    "colocated-unchunked": dict(colocated=True, chunk_size=4096, coordinator_args=("--local-chunk-size", "4096")),
}
WORKERS = {"disaggregated": 2, "colocated-chunked": 1, "colocated-unchunked": 1}


@dataclass
class Sample:
    kind: str  # "short" | "long"
    ttft: float
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0  # prompt_eval_count of the final chunk (what the model was fed)
    prefill_worker_s: float | None = None  # the final chunk's tandem.prefill_worker_s (remote prefills)


def stream(url: str, model: str, content: str, num_predict: int, kind: str) -> Sample | None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "options": {"temperature": 0, "num_predict": num_predict}}).encode()
    req = urllib.request.Request(url + "/api/chat", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    times, prompt_tokens, prefill_s = [], 0, None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            chunk = json.loads(line)
            if "error" in chunk:
                return None
            if not chunk.get("done") and chunk["message"]["content"]:
                times.append(time.perf_counter())
            if chunk.get("done"):
                prompt_tokens = chunk.get("prompt_eval_count", 0)
                prefill_s = (chunk.get("tandem") or {}).get("prefill_worker_s")
    if not times:
        return None
    return Sample(kind, times[0] - start, [b - a for a, b in zip(times, times[1:])], len(times), prompt_tokens,
                  prefill_s)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_load(url: str, model: str, duration: float, clients: int, long_every: float,
             long_words: int) -> tuple[list[Sample], float]:
    samples: list[Sample] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def record(s: Sample | None) -> None:
        if s is not None:
            with lock:
                samples.append(s)

    def chat_client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            record(stream(url, model, " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))), 48, "short"))

    def long_client() -> None:
        rng = random.Random(99)
        threads = []
        while time.monotonic() < stop_at:
            text = "Summarize this: " + " ".join(rng.choice(WORDS) for _ in range(long_words))
            t = threading.Thread(target=lambda text=text: record(stream(url, model, text, 8, "long")))
            t.start()
            threads.append(t)
            time.sleep(long_every)
        for t in threads:
            t.join()

    started = time.monotonic()
    workers = [threading.Thread(target=chat_client, args=(i,)) for i in range(clients)]
    workers.append(threading.Thread(target=long_client))
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return samples, time.monotonic() - started


def mode_topology(name: str, model: str, model_path: Path, log_dir: Path, threads: int, args,
                  **mode) -> Topology:
    """The local topology of one mode (a MODES entry, or any deploy.local_topology.Topology settings:
    benchmarks/validate_plan.py runs other P:D splits this way)."""
    settings = dict(prefill_threshold=128, worker_args=("--kv-cache-gb", "0.5"))
    settings.update(mode)
    topology = Topology(model=model, model_path=model_path, log_dir=log_dir / name, port=free_port(),
                        threads=threads, device=getattr(args, "device", "auto"),
                        cuda_graphs=not getattr(args, "no_cuda_graphs", False), **settings)
    topology.log_dir.mkdir(parents=True, exist_ok=True)
    return topology


def serving(topology: Topology, model: str):
    """A started, warmed-up cluster of `topology` (a context manager) and its URL."""
    specs, ready = plan(topology)
    cluster = LocalCluster(specs, ready, start_timeout_s=300)
    return cluster, ready.url


def warm_up(url: str, model: str) -> None:
    stream(url, model, "warm up", 4, "short")
    stream(url, model, "Summarize this: " + " ".join(WORDS * 20), 2, "long")


def bench_mode(name: str, model: str, model_path: Path, args, log_root: Path) -> dict:
    cores = args.threads_per_worker * WORKERS["disaggregated"]
    topology = mode_topology(name, model, model_path, log_root, cores // WORKERS[name], args, **MODES[name])
    cluster, url = serving(topology, model)
    with cluster:
        cluster.start()
        warm_up(url, model)
        samples, elapsed = run_load(url, model, args.duration, args.chat_clients, args.long_every, args.long_words)
    short = [s for s in samples if s.kind == "short"]
    long = [s for s in samples if s.kind == "long"]
    itl = [x for s in short for x in s.itls]
    return {"mode": name, "threads": f"{WORKERS[name]}x{cores // WORKERS[name]}", "requests": len(samples), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "itl_max": max(itl, default=float("nan")),
            "ttft_short_p50": pct([s.ttft for s in short], 50), "ttft_short_p99": pct([s.ttft for s in short], 99),
            "ttft_long_p50": pct([s.ttft for s in long], 50), "ttft_long_p99": pct([s.ttft for s in long], 99),
            "tok_s": sum(s.tokens for s in samples) / elapsed}


def main(argv: list[str] | None = None) -> None:
    from engine.device import add_device_flags
    from common.model_store import default_store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--chat-clients", type=int, default=4)
    p.add_argument("--long-every", type=float, default=3.0)
    p.add_argument("--long-words", type=int, default=1100)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="torch threads of each disaggregated worker; a colocated worker gets the pair's total")
    p.add_argument("--skip-transfer", action="store_true", help="skip the KV transfer table")
    p.add_argument("--json", action="store_true", help="print the per-mode rows as JSON instead of tables")
    add_device_flags(p)  # every worker's --device / --no-cuda-graphs
    args = p.parse_args(argv)
    model_path = default_store().resolve(args.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for name in args.modes.split(","):
            print(f"running {name} for {args.duration:.0f} s ...", flush=True, file=sys.stderr if args.json else sys.stdout)
            rows.append(bench_mode(name, args.model, model_path, args, Path(tmp)))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"\nload: {args.chat_clients} streaming chat clients (48 tokens each) + a ~{args.long_words}-word "
          f"prompt every {args.long_every:.1f} s, {args.duration:.0f} s per mode; times in ms")
    print(f"{'mode':22} {'procs x threads':>15} {'reqs':>5} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'TTFT short p50':>15} {'p99':>7} "
          f"{'TTFT long p50':>14} {'p99':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['mode']:22} {r['threads']:>15} {r['requests']:5d} {1e3 * r['itl_p50']:8.1f} {1e3 * r['itl_p99']:8.1f} "
              f"{1e3 * r['itl_max']:8.1f} "
              f"{1e3 * r['ttft_short_p50']:15.1f} {1e3 * r['ttft_short_p99']:7.1f} "
              f"{1e3 * r['ttft_long_p50']:14.1f} {1e3 * r['ttft_long_p99']:7.1f} {r['tok_s']:7.1f}")
    if not args.skip_transfer:
        print()
        subprocess.run([sys.executable, "-m", "benchmarks.bench_kvtransfer", "--reps", "2"], check=True)


if __name__ == "__main__":
    main()
