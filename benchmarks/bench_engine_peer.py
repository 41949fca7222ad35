"""tandem's engine against llama.cpp's llama-bench, side by side in one run: the same GGUF
files, the same thread counts, alternating sides round by round; prompt processing and decode.

    python -m benchmarks.bench_engine_peer --llama-bench PATH/llama-bench MODEL [MODEL ...]
        [--threads 1,2] [--rounds 2] [--prompt-len 512] [--context 64] [--decode-steps 32]
        [--batches 1,8]

Per model and round, one side then the other (the side that starts alternates), so drift of
the host's speed (up to 1.6x within an hour on this project's VMs) falls on both:

- the peer, at each thread count: `llama-bench -p PROMPT -n 0` (pp: one prompt of --prompt-len
  tokens) and `llama-bench -p 0 -n STEPS -d CONTEXT` (tg: one sequence decoding, its KV already
  --context deep), `-r 2 -o json`; its tg figure is its steps over their total time;
- tandem, at each thread count T, benchmarks.bench_engine's child at the host's dispatch level:
  the prompt as a prefill worker with `--threads T` runs it (`--prompt-only --formats auto`:
  the format its default --prefill-quant picks on this host, in the layouts made for prompt
  passes, torch on T threads), and decode as a decode worker with `--threads T` runs it (int4,
  what it runs on a Q4 file: the native kernels' pool on T threads, torch on one) at each of
  --batches, every sequence --context deep, over --decode-steps steps, from their mean step
  (as llama-bench's figure is).

Prints the CPU (model name and the flags the kernels dispatch on), this host's copy bandwidth,
the peer's build, then per model and thread count: each side's tok/s in every round, tandem
over the peer (median over rounds, and the range of each round's pair), and the last batch's
total tok/s over b=1, each against issue 22's bars: prompt processing and b=1 decode >= 1.0x
the peer at every thread count; b=8 total >= 5x b=1 (a bar the issue sets on a 1B model; judged
only where the last batch is 8).
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

PEER_BAR = 1.0  # tandem over llama-bench, prompt processing and b=1 decode, every thread count
BATCH_BAR = (8, 5.0)  # b=8 total tok/s over b=1's: the issue's bar, defined for that batch only
# The most prompt tokens one pass of a prefill worker holds (its default token budget,
# SchedulerConfig.max_num_batched_tokens) and one llama-bench ubatch: past it both split the
# prompt, each its own way, and one timed pass would no longer be what the worker runs.
MAX_PROMPT = 512


def peer_speed(llama_bench: str, model: Path, threads: list[int], prompt: int, gen: int, depth: int,
               reps: int) -> tuple[dict[int, float], str]:
    """llama-bench's tok/s per thread count for its one test (pp when gen is 0, else tg), and
    its build commit."""
    cmd = [llama_bench, "-m", str(model), "-t", ",".join(map(str, threads)), "-p", str(prompt), "-n", str(gen),
           "-d", str(depth), "-r", str(reps), "-o", "json"]
    env = dict(os.environ)
    # llama.cpp's shared build keeps libggml beside its binaries.
    here = str(Path(llama_bench).resolve().parent)
    env["LD_LIBRARY_PATH"] = here + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        # -d (KV depth) came with llama.cpp's PR #13096 (April 2025): an older build refuses it.
        older = " (-d, the KV depth, needs a llama-bench from April 2025 on)" if "-d" in out.stderr else ""
        raise SystemExit(f"{' '.join(cmd)} exited with {out.returncode}: {out.stderr.strip()[-500:]}{older}")
    test = f"pp{prompt}" if gen == 0 else f"tg{gen}"
    try:
        rows = json.loads(out.stdout)
        tok_s = {int(r["n_threads"]): float(r["avg_ts"]) for r in rows
                 if r.get("n_prompt") == prompt and r.get("n_gen") == gen and r.get("n_depth", 0) == depth}
        build = str(rows[0].get("build_commit", "?")) if rows else "?"
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SystemExit(f"llama-bench printed no {test} rows this script can read ({exc}): {out.stdout[:300]!r}")
    missing = [t for t in threads if t not in tok_s]
    if missing:
        raise SystemExit(f"llama-bench gave no {test} row for threads {missing}: {out.stdout[:300]!r}")
    return tok_s, build


def tandem_row(model: Path, threads: int, **options) -> dict:
    """bench_engine's one row for `model` at `threads`, from its child at the host's dispatch
    level. A child that fails (a file tandem refuses, say) has printed its error on this
    process's stderr; the benchmark stops there with a line naming the model."""
    child = argparse.Namespace(model=str(model), threads=threads, kv_dtype="fp32", device="cpu",
                               prefill_lens=None, **options)
    try:
        (row,) = run_child(child, native.dispatch_level())["rows"]
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"tandem's bench_engine child failed on {model.name} at {threads} thread(s) "
                         f"(exit {exc.returncode}); its error is above") from None
    return row


def tandem_prefill(model: Path, threads: int, args) -> tuple[float, str]:
    """Prompt tok/s of one --prompt-len pass as a prefill worker runs it, and its format."""
    row = tandem_row(model, threads, formats="auto", prompt_only=True, prompt_len=args.prompt_len,
                     repeats=args.peer_reps, context=1, batches="1", decode_steps=1)
    return row["prefill_tok_s"], row["format"]


def tandem_decode(model: Path, threads: int, args) -> dict[int, float]:
    """bench_engine's int4 decode tok/s (total over the batch) per batch size, at `threads`,
    from its mean step: llama-bench's tg figure is its steps over their total time, so a slow
    step (a page fault, a preemption) counts on both sides, where a median would drop ours."""
    row = tandem_row(model, threads, formats="int4", prompt_len=args.context, context=args.context,
                     batches=args.batches, decode_steps=args.decode_steps, repeats=1)
    return {d["batch"]: d["batch"] / d["mean_step_s"] for d in row["decode"]}


def parse_counts(spec: str, name: str) -> list[int]:
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise SystemExit(f"{name}: distinct comma-separated counts >= 1, got {spec!r}")
    return counts


def verdict(value: float, bar: float) -> str:
    """Judged on the value as printed (two decimals), so the two never disagree."""
    return f"{'met' if round(value, 2) >= bar else 'short of'} {bar:g}x"


def figures(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def against_peer(ours: list[float], peer: list[float]) -> str:
    """The ratio of the medians, and the range of each round's pair."""
    pairs = [o / p for o, p in zip(ours, peer)]
    ratio = statistics.median(ours) / statistics.median(peer)
    return f"{f'{ratio:.2f}x ({min(pairs):.2f}-{max(pairs):.2f})':>16}  {verdict(ratio, PEER_BAR):>12}"


def report(model: Path, rounds: list[dict], threads: list[int], batches: list[int]) -> list[str]:
    """The lines for one model. rounds: [{"peer_tg": {t: tok/s}, "tandem": {t: {batch: tok/s}}}
    and, where the prompt was timed, "peer_pp": {t: tok/s}, "prefill": {t: (tok/s, format)}]."""
    lines = [f"{model.name}"]
    if "prefill" in rounds[0]:
        lines.append(f"  {'threads':>7}  {'llama.cpp pp':>16}  {'tandem prefill':>16}  {'tandem/peer':>16}  "
                     f"{'bar':>12}  format")
        for t in threads:
            peer, ours = [r["peer_pp"][t] for r in rounds], [r["prefill"][t][0] for r in rounds]
            # `auto` is resolved per thread count (bf16's speed is measured at each).
            fmt = ",".join(sorted({r["prefill"][t][1] for r in rounds}))
            lines.append(f"  {t:7d}  {figures(peer):>16}  {figures(ours):>16}  {against_peer(ours, peer)}  {fmt}")
    lines.append(f"  {'threads':>7}  {'llama.cpp tg':>16}  {'tandem b=1':>16}  {'tandem/peer':>16}  "
                 f"{'b=1 bar':>12}" + (f"  {'tandem b=' + str(batches[-1]):>16}  {'x b=1':>6}  {'batch bar':>12}"
                                      if len(batches) > 1 else ""))
    for t in threads:
        peer = [r["peer_tg"][t] for r in rounds]
        b1 = [r["tandem"][t][batches[0]] for r in rounds]
        line = f"  {t:7d}  {figures(peer):>16}  {figures(b1):>16}  {against_peer(b1, peer)}"
        if len(batches) > 1:
            big = [r["tandem"][t][batches[-1]] for r in rounds]
            amort = statistics.median(big) / statistics.median(b1)
            batch, bar = BATCH_BAR
            judged = verdict(amort, bar) if batches[-1] == batch else "-"
            line += f"  {figures(big):>16}  {amort:5.2f}x  {judged:>12}"
        lines.append(line)
    return lines


def run_round(model: Path, threads: list[int], args, peer_first: bool) -> tuple[dict, str]:
    """One round on one model: each side's figures at every thread count, the peer's build."""
    done: dict = {}
    build = "?"
    for side in (("peer", "tandem") if peer_first else ("tandem", "peer")):
        if side == "peer":
            if args.prompt_len:
                done["peer_pp"], build = peer_speed(args.llama_bench, model, threads, args.prompt_len, 0, 0,
                                                    args.peer_reps)
            done["peer_tg"], build = peer_speed(args.llama_bench, model, threads, 0, args.decode_steps,
                                                args.context, args.peer_reps)
        else:
            if args.prompt_len:
                done["prefill"] = {t: tandem_prefill(model, t, args) for t in threads}
            done["tandem"] = {t: tandem_decode(model, t, args) for t in threads}
    return done, build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="GGUF files (or model names tandem's store resolves)")
    p.add_argument("--llama-bench", required=True, help="path of llama.cpp's llama-bench binary")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=2, help="alternations of (peer, tandem) per model")
    p.add_argument("--prompt-len", type=int, default=MAX_PROMPT,
                   help=f"prompt tokens of the prefill test, at most {MAX_PROMPT} (one pass); 0: none")
    p.add_argument("--context", type=int, default=64, help="KV depth each decoding sequence already holds")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batches", default="1,8", help="tandem batch sizes; the first is the one compared")
    p.add_argument("--peer-reps", type=int, default=2, help="llama-bench -r (and tandem's prompt repeats)")
    args = p.parse_args(argv)
    threads = parse_counts(args.threads, "--threads")
    batches = parse_counts(args.batches, "--batches")
    if batches[0] != 1 or batches != sorted(batches):
        p.error("--batches must start at 1 (the batch compared with the peer's single sequence) and ascend")
    if args.prompt_len > MAX_PROMPT:
        p.error(f"--prompt-len {args.prompt_len}: at most {MAX_PROMPT}, the tokens one prefill pass holds")
    if args.rounds < 1 or args.context < 1 or args.decode_steps < 1 or args.peer_reps < 1 or args.prompt_len < 0:
        p.error("--rounds, --context, --decode-steps and --peer-reps must be >= 1, --prompt-len >= 0")
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
    print(f"prompt: {args.prompt_len} tokens (llama-bench: mean of -r {args.peer_reps}; tandem: median of "
          f"{args.peer_reps} passes after a warm-up); decode at KV depth {args.context}, {args.decode_steps} "
          f"steps (tandem int4: mean step); dispatch level {native.dispatch_level()}; {args.rounds} "
          f"alternating rounds", flush=True)
    build = "?"
    for model in models:
        rounds = []
        for number in range(args.rounds):
            done, build = run_round(model, threads, args, peer_first=number % 2 == 0)
            rounds.append(done)
            print(f"{model.name}: round {number + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        print()
        print("\n".join(report(model, rounds, threads, batches)), flush=True)
    print()
    print(f"peer: {args.llama_bench} (build {build})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
