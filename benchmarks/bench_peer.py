"""tandem against a peer server, side by side in one run: the same workloads through `tandem
bench` against both servers' OpenAI endpoints, alternating servers round by round.

    python -m benchmarks.bench_peer --peer-server PATH/llama-server [--model smollm2] [--rounds 2]
                                [--threads 2] [--tandem-args "--decode-quant int4"]

The peer is llama.cpp's llama-server on the same GGUF (../shared/peer/llamacpp.sh builds it;
nothing of it is in this repo), started with --threads threads and 8 slots; tandem is `tandem
serve` with its defaults (one prefill and one decode worker, one thread each), so both use the
same cores. Workloads (DESIGN.md's metrics, measured at the client, greedy):

    chat8     8 clients, ~235-token prompts, 64 tokens out
    decode1   1 client, 16-token prompts, 64 tokens out
    decode8   8 clients, 16-token prompts, 64 tokens out

Prints per workload: output tok/s, TPOT p50, ITL p99, TTFT p50/p99 for each server and the
ratio tandem / peer (for output tok/s higher is better; for latencies lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from deploy.process_plan import free_port

WORKLOADS = {
    "chat8": ["--input-len", "235", "--output-len", "64", "--num-prompts", "24", "--concurrency", "8"],
    "decode1": ["--input-len", "16", "--output-len", "64", "--num-prompts", "6", "--concurrency", "1"],
    "decode8": ["--input-len", "16", "--output-len", "64", "--num-prompts", "24", "--concurrency", "8"],
}
METRICS = [  # (label, summary path, higher is better)
    ("output tok/s", ("output_throughput",), True),
    ("TPOT p50 ms", ("tpot_ms", "p50"), False),
    ("ITL p99 ms", ("itl_ms", "p99"), False),
    ("TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("TTFT p99 ms", ("ttft_ms", "p99"), False),
]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def run_bench(base_url: str, model: str, tokenizer: str, workload: list[str], seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "cli.main", "bench", "--backend", "openai", "--base-url", base_url,
               "--model", model, "--tokenizer", tokenizer, "--temperature", "0", "--no-progress",
               "--seed", str(seed), "--result-json", out.name, *workload]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())["levels"][0]["summary"]


def value(summary: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        summary = summary.get(key) if isinstance(summary, dict) else None
    return summary


def main(argv: list[str] | None = None) -> int:
    from common.model_store import default_store

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-server", required=True, help="path of llama.cpp's llama-server binary")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=2, help="alternations of (peer, tandem) per workload")
    p.add_argument("--threads", type=int, default=2, help="peer threads (tandem: one per worker)")
    p.add_argument("--tandem-args", default="", help="extra `tandem serve` arguments")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args(argv)
    gguf = str(default_store().resolve(args.model))
    peer_port, tandem_port = free_port(), free_port()
    procs = []
    servers = {"llama.cpp": f"http://127.0.0.1:{peer_port}", "tandem": f"http://127.0.0.1:{tandem_port}"}
    try:
        # One server at a time, each ready (its workers registered) before the next starts: a
        # server's start-up times kernels on this host (kernels/layout_choice.py), which the
        # other's model load beside it would skew.
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--model", args.model, "--port", str(tandem_port),
             "--grpc-port", "0", *shlex.split(args.tandem_args)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        wait_ready(servers["tandem"] + "/health", procs[0], 300)
        procs.append(subprocess.Popen(
            [args.peer_server, "-m", gguf, "-t", str(args.threads), "-np", "8", "-c", "16384",
             "--host", "127.0.0.1", "--port", str(peer_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        wait_ready(servers["llama.cpp"] + "/health", procs[1], 120)
        model_names = {"llama.cpp": "model", "tandem": args.model}
        results: dict[str, dict[str, list[dict]]] = {}
        for number, name in enumerate(args.workloads.split(",")):
            results[name] = {s: [] for s in servers}
            # Each round of each workload its own prompts (both servers the same ones): a repeat
            # of an earlier round's would be answered from either server's prompt cache.
            for round_index in range(args.rounds):
                for server, url in servers.items():
                    results[name][server].append(run_bench(
                        url, model_names[server], gguf, WORKLOADS[name],
                        seed=1000 * number + round_index))
        print(f"peer: {args.peer_server} (-t {args.threads}); tandem serve {args.tandem_args}; "
              f"median of {args.rounds} alternating rounds")
        print(f"{'workload':10} {'metric':14} {'llama.cpp':>10} {'tandem':>10} {'tandem/peer':>12}")
        for name, per_server in results.items():
            for label, path, _ in METRICS:
                figures = {}
                for server, summaries in per_server.items():
                    vals = [v for v in (value(s, path) for s in summaries) if v is not None]
                    figures[server] = statistics.median(vals) if vals else None
                peer, ours = figures["llama.cpp"], figures["tandem"]
                ratio = f"{ours / peer:.2f}x" if peer and ours is not None else "-"
                print(f"{name:10} {label:14} {peer or 0:10.1f} {ours or 0:10.1f} {ratio:>12}")
            outs = {s: sum(x["output_tokens"] for x in v) for s, v in per_server.items()}
            fails = {s: sum(x["failed"] for x in v) for s, v in per_server.items()}
            again = {s: sum(x.get("retried", 0) for x in v) for s, v in per_server.items()}
            print(f"{name:10} {'tokens, failed':14} {outs['llama.cpp']:>6},{fails['llama.cpp']:<3} "
                  f"{outs['tandem']:>6},{fails['tandem']:<3}")
            print(f"{name:10} {'sent twice':14} {again['llama.cpp']:>10} {again['tandem']:>10}")
        return 0
    finally:
        stop_servers(procs)


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGINT every server's process group (each was started in its own session), then
    SIGKILL the groups still there after 30 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
