"""Decode speed against llama.cpp's llama-bench, side by side in one run: the same GGUF files,
the same thread counts, the same KV depth, alternating sides round by round.

    python -m benchmarks.bench_decode_peer --llama-bench PATH/llama-bench MODEL [MODEL ...]
        [--threads 1,2] [--rounds 2] [--context 64] [--decode-steps 32] [--batches 1,8]

Per model and round, one side then the other (the side that starts alternates), so drift of
the host's speed (up to 1.6x within an hour on this project's VMs) falls on both:

- the peer: `llama-bench -m MODEL -t THREADS -p 0 -n STEPS -d CONTEXT -r 2 -o json`, its tg
  tok/s at each thread count (one sequence decoding, KV already --context deep);
- tandem: benchmarks.bench_engine's child at the host's dispatch level, int4 decode (what a
  decode worker runs on a Q4 file), for each thread count: `--threads T` gives the native
  kernels' pool T threads and keeps torch at one, as a decode worker does (worker/runtime.py);
  decode at each of --batches, every sequence --context deep, median step of --decode-steps.

Prints the CPU (model name and the flags the kernels dispatch on), this host's copy bandwidth,
the peer's build, then per model and thread count: each side's tok/s in every round, tandem
b=1 over the peer (median over rounds and the range of each round's pair), and the first batch
above 1 as its total tok/s over b=1, each against issue 22's bars (b=1 >= 1.0x the peer at
every thread count; b=8 total >= 5x b=1, a bar the issue sets on the 1B model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_engine import copy_bandwidth, cpu_summary, resolve, run_child
from common.errors import ModelNotFoundError
from kernels import native

B1_BAR = 1.0  # tandem b=1 over llama-bench tg, at every thread count
BATCH_BAR = 5.0  # b=8 total tok/s over b=1's


def peer_decode(llama_bench: str, model: Path, threads: list[int], steps: int, context: int,
                reps: int) -> tuple[dict[int, float], str]:
    """llama-bench's tg tok/s per thread count, and its build commit."""
    cmd = [llama_bench, "-m", str(model), "-t", ",".join(map(str, threads)), "-p", "0", "-n", str(steps),
           "-d", str(context), "-r", str(reps), "-o", "json"]
    env = dict(os.environ)
    # llama.cpp's shared build keeps libggml beside its binaries.
    here = str(Path(llama_bench).resolve().parent)
    env["LD_LIBRARY_PATH"] = here + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr.strip()[-500:]}")
    try:
        rows = json.loads(out.stdout)
        tok_s = {int(r["n_threads"]): float(r["avg_ts"]) for r in rows
                 if r.get("n_prompt") == 0 and r.get("n_gen") == steps}
        build = str(rows[0].get("build_commit", "?")) if rows else "?"
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SystemExit(f"llama-bench printed no tg rows this script can read ({exc}): {out.stdout[:300]!r}")
    missing = [t for t in threads if t not in tok_s]
    if missing:
        raise SystemExit(f"llama-bench gave no tg row for threads {missing}: {out.stdout[:300]!r}")
    return tok_s, build


def tandem_decode(model: Path, threads: int, args) -> dict[int, float]:
    """bench_engine's int4 decode tok/s (total over the batch) per batch size, at `threads`."""
    child = argparse.Namespace(
        model=str(model), formats="int4", prompt_len=args.context, context=args.context, batches=args.batches,
        decode_steps=args.decode_steps, repeats=1, threads=threads, kv_dtype="fp32", device="cpu",
        prefill_lens=None)
    (row,) = run_child(child, native.dispatch_level())["rows"]
    return {d["batch"]: d["batch"] / d["step_s"] for d in row["decode"]}


def parse_counts(spec: str, name: str) -> list[int]:
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise SystemExit(f"{name}: distinct comma-separated counts >= 1, got {spec!r}")
    return counts


def verdict(value: float, bar: float) -> str:
    return f"{'met' if value >= bar else 'short of'} {bar:g}x"


def report(model: Path, rounds: list[dict], threads: list[int], batches: list[int]) -> list[str]:
    """The lines for one model. rounds: [{"peer": {t: tok/s}, "tandem": {t: {batch: tok/s}}}]."""
    lines = [f"{model.name}"]
    lines.append(f"  {'threads':>7}  {'llama.cpp tg':>16}  {'tandem b=1':>16}  {'tandem/peer':>16}  "
                 f"{'b=1 bar':>12}" + (f"  {'tandem b=' + str(batches[-1]):>16}  {'x b=1':>6}  {'batch bar':>12}"
                                      if len(batches) > 1 else ""))
    for t in threads:
        peer = [r["peer"][t] for r in rounds]
        b1 = [r["tandem"][t][batches[0]] for r in rounds]
        pairs = [o / p for o, p in zip(b1, peer)]
        ratio = statistics.median(b1) / statistics.median(peer)
        line = (f"  {t:7d}  {' / '.join(f'{v:.1f}' for v in peer):>16}  {' / '.join(f'{v:.1f}' for v in b1):>16}  "
                f"{f'{ratio:.2f}x ({min(pairs):.2f}-{max(pairs):.2f})':>16}  {verdict(ratio, B1_BAR):>12}")
        if len(batches) > 1:
            big = [r["tandem"][t][batches[-1]] for r in rounds]
            amort = statistics.median(big) / statistics.median(b1)
            line += (f"  {' / '.join(f'{v:.1f}' for v in big):>16}  {amort:5.2f}x  {verdict(amort, BATCH_BAR):>12}")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="GGUF files (or model names tandem's store resolves)")
    p.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=2, help="alternations of (peer, tandem) per model")
    p.add_argument("--context", type=int, default=64, help="KV depth each decoding sequence already holds")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batches", default="1,8", help="tandem batch sizes; the first is the one compared")
    p.add_argument("--peer-reps", type=int, default=2, help="llama-bench -r")
    args = p.parse_args(argv)
    threads = parse_counts(args.threads, "--threads")
    batches = parse_counts(args.batches, "--batches")
    if batches[0] != 1:
        p.error("--batches must start at 1 (the batch compared with the peer's single sequence)")
    if args.rounds < 1 or args.context < 1 or args.decode_steps < 1 or args.peer_reps < 1:
        p.error("--rounds, --context, --decode-steps and --peer-reps must be >= 1")
    if not os.access(args.llama_bench, os.X_OK):
        p.error(f"--llama-bench {args.llama_bench!r} is not an executable file")
    models = []
    for name in args.models:
        try:
            models.append(resolve(name))
        except ModelNotFoundError as exc:
            p.error(f"model {name!r}: {exc}")
    print(cpu_summary())
    print(f"copy bandwidth: {copy_bandwidth():.2f} GB/s (dst.copy_(src), 256 MB fp32, read+write, best of 5)")
    print(f"decode at KV depth {args.context}, {args.decode_steps} steps; tandem int4 at dispatch level "
          f"{native.dispatch_level()}, median step; llama-bench tg, mean of -r {args.peer_reps}; "
          f"{args.rounds} alternating rounds", flush=True)
    build = "?"
    for model in models:
        rounds = []
        for number in range(args.rounds):
            done: dict = {}
            # Even rounds start with the peer, odd ones with tandem.
            for side in (("peer", "tandem") if number % 2 == 0 else ("tandem", "peer")):
                if side == "peer":
                    done["peer"], build = peer_decode(args.llama_bench, model, threads, args.decode_steps,
                                                      args.context, args.peer_reps)
                else:
                    done["tandem"] = {t: tandem_decode(model, t, args) for t in threads}
            rounds.append(done)
            print(f"{model.name}: round {number + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        print()
        print("\n".join(report(model, rounds, threads, batches)), flush=True)
    print()
    print(f"peer: {args.llama_bench} (build {build})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
