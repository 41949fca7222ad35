"""`tandem serve` with and without its host's core lease (common/core_lease.py), side by side,
alternating round by round (the host is shared and noisy: compare ratios, not figures).

    python -m benchmarks.bench_core_lease [--model smollm2] [--rounds 3] [--tandem-args ...]

Both servers run at once with their defaults (one prefill and one decode worker, one thread
each); the one not measured is idle, its workers asleep. Workloads, each through `tandem
bench` against the OpenAI endpoint, greedy:

    decode1   1 client, 16-token prompts, 128 tokens out: a lone stream, no prefill running
    mixed     the same stream while another client sends 400-token prompts for 1 token each
              (prefill work on the prefill worker, which takes its core back from the decode
              worker's pool for every pass): the stream's ITL and TPOT, the prompts' TTFT

The int4 layout is chosen by measurement per native thread count (kernels/layout_choice.py),
so a decode worker whose pool the lease sized at 2 may run another int4 kernel than one at 1
(here: the native one against aten's). `--same-layout` serves both from a temporary
$TANDEM_HOME whose layouts.json names the native layout (q4_1) for every thread count, so the
two differ in the lease alone.

Prints per workload and metric the median of the rounds with and without the lease and their
ratio (lease / no lease: for tok/s higher is better, for latencies lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.bench_peer import stop_servers, value, wait_ready
from deploy.process_plan import free_port

STREAM = ["--input-len", "16", "--output-len", "128", "--num-prompts", "3", "--concurrency", "1"]
PROMPTS = ["--input-len", "400", "--output-len", "1", "--num-prompts", "8", "--concurrency", "1"]
METRICS = {  # workload: [(label, which run, summary path)]
    "decode1": [("output tok/s", "stream", ("output_throughput",)),
                ("TPOT p50 ms", "stream", ("tpot_ms", "p50")),
                ("ITL p99 ms", "stream", ("itl_ms", "p99"))],
    "mixed": [("stream tok/s", "stream", ("output_throughput",)),
              ("TPOT p50 ms", "stream", ("tpot_ms", "p50")),
              ("ITL p50 ms", "stream", ("itl_ms", "p50")),
              ("ITL p99 ms", "stream", ("itl_ms", "p99")),
              ("prompt TTFT p50", "prompts", ("ttft_ms", "p50")),
              ("prompt TTFT p99", "prompts", ("ttft_ms", "p99"))],
}


def bench(base_url: str, model: str, tokenizer: str, workload: list[str], seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "cli.main", "bench", "--backend", "openai", "--base-url", base_url,
               "--model", model, "--tokenizer", tokenizer, "--temperature", "0", "--no-progress",
               "--seed", str(seed), "--result-json", out.name, *workload]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["levels"][0]["summary"]


def run_workload(name: str, url: str, model: str, tokenizer: str, seed: int) -> dict[str, dict]:
    if name == "decode1":
        return {"stream": bench(url, model, tokenizer, STREAM, seed)}
    with ThreadPoolExecutor(2) as pool:  # the stream starts first; the prompts arrive during it
        stream = pool.submit(bench, url, model, tokenizer, STREAM, seed)
        prompts = pool.submit(bench, url, model, tokenizer, PROMPTS, seed + 1)
        return {"stream": stream.result(), "prompts": prompts.result()}


def main(argv: list[str] | None = None) -> int:
    from common.model_store import default_store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3, help="alternations of (lease, no lease) per workload")
    p.add_argument("--tandem-args", default="", help="extra `tandem serve` arguments for both")
    p.add_argument("--workloads", default=",".join(METRICS))
    p.add_argument("--same-layout", action="store_true",
                   help="both servers on the native int4 layout (see above)")
    args = p.parse_args(argv)
    gguf = str(default_store().resolve(args.model))
    servers = {"lease": [], "no lease": ["--no-core-lease"]}
    urls, procs = {}, []
    env, model = dict(os.environ), args.model
    home = tempfile.TemporaryDirectory() if args.same_layout else None
    if home is not None:
        from kernels.layout_choice import host_key
        from kernels import native

        native_dir = Path(home.name) / "native"
        native_dir.mkdir(mode=0o700)
        keys = {}
        for threads in (1, 2):
            native.set_threads(threads)
            keys[host_key("int4")] = "q4_1"
        native.set_threads(1)
        (native_dir / "layouts.json").write_text(json.dumps(keys, indent=1))
        env["TANDEM_HOME"], model = home.name, gguf
    logs = tempfile.mkdtemp(prefix="bench-core-lease-")  # one log folder per server, kept
    try:
        for name, extra in servers.items():
            port = free_port()
            extra = [*extra, "--log-dir", os.path.join(logs, name.replace(" ", "-"))]
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "cli.main", "serve", "--model", model, "--port", str(port),
                 "--grpc-port", "0", *extra, *shlex.split(args.tandem_args)], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            urls[name] = f"http://127.0.0.1:{port}"
        for proc, url in zip(procs, urls.values()):
            wait_ready(url + "/health", proc, 300)
        for url in urls.values():  # warm-up, not counted: both roles have served once
            bench(url, model, gguf, ["--input-len", "400", "--output-len", "8",
                                          "--num-prompts", "2", "--concurrency", "1"], seed=99)
        results: dict[str, dict[str, list[dict]]] = {}
        for workload in args.workloads.split(","):
            results[workload] = {s: [] for s in servers}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for server in order:
                    results[workload][server].append(
                        run_workload(workload, urls[server], model, gguf, seed=r))
        print(f"tandem serve {args.tandem_args} with and without the core lease"
              f"{' (both on the native int4 layout)' if home else ''}; {os.cpu_count()} CPUs; "
              f"median of {args.rounds} alternating rounds; logs in {logs}")
        print(f"{'workload':9} {'metric':16} {'lease':>9} {'no lease':>9} {'ratio':>7}")
        for workload, per_server in results.items():
            for label, run, path in METRICS[workload]:
                med = {}
                for server, rounds in per_server.items():
                    vals = [v for v in (value(x[run], path) for x in rounds) if v is not None]
                    med[server] = statistics.median(vals) if vals else None
                a, b = med["lease"], med["no lease"]
                ratio = f"{a / b:.2f}x" if a is not None and b else "-"
                print(f"{workload:9} {label:16} {a or 0:9.1f} {b or 0:9.1f} {ratio:>7}")
            for server, rounds in per_server.items():
                fails = sum(x[k]["failed"] for x in rounds for k in x)
                per_round = ", ".join(f"{value(x['stream'], ('output_throughput',)):.1f}" for x in rounds)
                print(f"{workload:9} {server:9} stream tok/s per round: {per_round}; failed {fails}")
        return 0
    finally:
        stop_servers(procs)
        if home is not None:
            home.cleanup()


if __name__ == "__main__":
    sys.exit(main())
