"""Engine benchmark: prefill and decode speed of one model, per weight format and per aten
dispatch level, in one run so the figures compare.

    python -m benchmarks.bench_engine [MODEL] [--formats fp32,bf16,int8,int4,w8a8] [--levels LEVELS]
                                  [--prompt-len 512] [--context 512] [--batches 1,8,32]
                                  [--decode-steps 32] [--repeats 3] [--threads 1] [--kernels]
                                  [--prompt-only]

Prints the CPU (model name; avx2, avx512f, avx512_vnni, avx512_bf16 from /proc/cpuinfo), the
torch version and thread count, this host's copy bandwidth (dst.copy_(src) of 256 MB fp32, best
of 5, read+write bytes), then per dispatch level and format:

- prefill tokens/s for one prompt of --prompt-len tokens in a single pass (and, with
  --prefill-lens, the seconds of one pass at each of those lengths, in the JSON rows'
  prefill_points: what benchmarks.profile_host fits the planner's prefill cost from);
- decode tokens/s at each batch size (every sequence one token per step, each sequence's KV
  already holding --context tokens; median step of --decode-steps), with the bytes one step
  reads (every projection and the lm_head: weight, scales and zeros; plus the batch's KV at
  --context) and the GB/s that implies, beside the copy bandwidth;
- each batch's total tokens/s over batch 1's (what batching amortizes), and each format against
  the first.

--levels: comma-separated among kernels.native.LEVELS up to this host's own level, or 'all';
default: the host's level, plus avx2 when that is lower ('default' is the portable build and
several times slower). aten reads ATEN_CPU_CAPABILITY once at import, so each level runs in a
child (`--one-level --json` with that variable set) and the parent prints one table.
--one-level runs only this process's level, in process. --kernels first runs the kernel
micro-benchmarks (benchmarks.bench_linear, benchmarks.bench_attention).

--prompt-only: each format packed as a prefill worker packs it (the layouts made for prompt
passes; `auto`, the default --prefill-quant, resolved as that worker resolves it on this host,
engine/format_choice.py choose_on_this_host) and timed in prompt passes only, no decode: what
benchmarks.bench_engine_peer sets against llama-bench's prompt processing.

--device cuda (engine/device.py): the model and KV cache on the GPU, Triton kernels, decode
steps as CUDA graphs unless --no-cuda-graphs; every timing ends with a device synchronize, the
copy bandwidth is a device-to-device copy, and the one "level" runs in process (aten's CPU
dispatch levels do not apply).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.device import add_device_flags, resolve_device
from engine.format_choice import AUTO_FORMAT, choose_on_this_host
from engine.kv_cache_sizing import KV_TORCH_DTYPES
from engine.loaders import load_model
from engine.model_runner import ModelRunner, SequenceChunk, kv_cache_bytes_per_block
from engine.models import model_class
from worker.runtime import configure_process, worker_env
from kernels import native
from kernels.linear import packed_nbytes

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
BLOCK_SIZE = 16


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every projection and the lm_head."""
    layers = sum(packed_nbytes(lin) for layer in model.layers
                 for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    return layers + packed_nbytes(model.lm_head)


def synchronize(device: torch.device | str = "cpu") -> None:
    """Waits for the device's queued work (a no-op on the CPU), so a timing covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    fn()  # warm-up
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(mbytes: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Read+write GB/s of a plain tensor copy: the ceiling a decode step's weight reads can reach
    (on a GPU, its HBM bandwidth as a device-to-device copy sees it)."""
    src = torch.ones(mbytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # faults dst's pages in before timing
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best / 1e9


def fill_context(runner: ModelRunner, tables: list[list[int]], vocab: int, context: int, prompt_len: int) -> None:
    """Give every sequence `context` cached tokens. Sequence 0 is prefilled (unless the timed
    prompt already covered `context` positions); the others get copies of its blocks, since a
    decode step's cost depends on how many tokens it reads, not on their values, and 31 more
    prefills would dominate the run."""
    if context > prompt_len:
        prompt = torch.randint(100, vocab, (context,), generator=torch.Generator().manual_seed(1)).tolist()
        runner.execute([SequenceChunk(prompt, 0, tables[0], False)])
    kv, n = runner.kv_cache, (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    for table in tables[1:]:  # each table is a contiguous block range
        kv[:, :, table[0]:table[0] + n] = kv[:, :, tables[0][0]:tables[0][0] + n]


def decode_step_times(runner: ModelRunner, tables: list[list[int]], context: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps, all sequences at once. Step s writes position
    context + s; the warm-up step writes the first of them, which step 0 rewrites."""
    def step(s: int) -> None:
        runner.execute([SequenceChunk([42], context + s, t, True) for t in tables])

    step(0)
    synchronize(runner.device)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step(s)
        synchronize(runner.device)
        times.append(time.perf_counter() - t0)
    return times


def bench_format(loaded, fmt: str, args) -> dict:
    config = loaded.config
    device = getattr(args, "device", "cpu")
    prompt_only = getattr(args, "prompt_only", False)
    head = None
    if fmt == AUTO_FORMAT:  # what a prefill worker resolves `auto` to here
        if not prompt_only:
            raise ValueError(f"format {AUTO_FORMAT!r} is a prefill worker's: time it with prompt_only")
        choice = choose_on_this_host(config, loaded.weights, torch.device(device).type)
        fmt, head = choice.format, choice.prompt_head
    # Packed as a decode worker packs it, torch at one thread (worker/runtime.py): the int4
    # layout is chosen by timing aten's kernel on torch's threads against the native pool, and
    # the decode steps below run with torch at one thread too. A prefill worker's copy
    # (--prompt-only) is packed on all its threads, in the layouts made for prompt passes.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads if prompt_only else 1)
    try:
        model = model_class(config.architecture)(config, loaded.weights, fmt, device=device,
                                                 prompt_only=prompt_only, prompt_head_format=head)
    finally:
        torch.set_num_threads(torch_threads)
    batches = [int(b) for b in args.batches.split(",")]
    prefill_lens = parse_lens(getattr(args, "prefill_lens", None))
    longest = max([args.prompt_len, *prefill_lens])
    per_seq = (max(longest, args.context + args.decode_steps) + BLOCK_SIZE - 1) // BLOCK_SIZE
    kv_dtype = KV_TORCH_DTYPES[args.kv_dtype]
    runner = ModelRunner(model, CacheConfig(block_size=BLOCK_SIZE, num_blocks=max(batches) * per_seq), kv_dtype,
                         cuda_graphs=not getattr(args, "no_cuda_graphs", False))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(batches))]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, config.vocab_size, (longest,), generator=gen).tolist()

    def prefill_time(n: int) -> float:
        return time_it(lambda: runner.execute([SequenceChunk(tokens[:n], 0, tables[0], True)]), args.repeats,
                       runner.device)

    prefill_s = prefill_time(args.prompt_len)
    # More single-pass prompt lengths, for the planner's prefill fit (three coefficients: a
    # point per --prompt-len alone leaves the fit no residual to average the noise out).
    prefill_points = [[n, prefill_time(n)] for n in prefill_lens]
    if not prompt_only:
        fill_context(runner, tables, config.vocab_size, args.context, args.prompt_len)
    kv_per_seq = kv_cache_bytes_per_block(config, args.context, runner.kv_cache.dtype)
    # Decode steps as a decode worker runs them: its --threads go to the native kernels' pool
    # and torch keeps one thread (worker/runtime.py configure_process); prefill used them all.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {b: [] if prompt_only else decode_step_times(runner, tables[:b], args.context, args.decode_steps)
                 for b in batches}
    finally:
        torch.set_num_threads(torch_threads)
    # step_s: the median step (this table's figure); mean_step_s: all steps over their count, as
    # llama-bench's tg figure counts them (benchmarks.bench_engine_peer).
    decode = [{"batch": b, "step_s": statistics.median(t), "mean_step_s": statistics.fmean(t),
               "kv_bytes": kv_per_seq * b} for b, t in steps.items() if t]
    # prompt_len and context make a row self-describing: planner/cost_profile.py fits its
    # cost models from rows measured at several of them.
    row = {"format": fmt, "prompt_len": args.prompt_len, "context": args.context,
           "prefill_tok_s": args.prompt_len / prefill_s, "weight_bytes": weight_bytes(model),
           "decode": decode}
    if prefill_points:
        row["prefill_points"] = prefill_points  # [prompt tokens, seconds of its one pass]
    return row


def parse_lens(spec: str | None) -> list[int]:
    """--prefill-lens: comma-separated prompt lengths (none when unset)."""
    if not spec:
        return []
    try:
        lens = [int(n) for n in spec.split(",")]
    except ValueError:
        lens = []
    if not lens or any(n < 1 for n in lens):
        raise ValueError(f"--prefill-lens: comma-separated lengths >= 1, got {spec!r}")
    return lens


def run_level(args) -> dict:
    """Every format at this process's dispatch level. One weights load; one model and KV cache
    per format, freed before the next (batch 32 x context 512 of fp32 KV is over 1 GB)."""
    device = torch.device(getattr(args, "device", "cpu"))
    level = native.dispatch_level() if device.type == "cpu" else str(device)
    loaded = load_model(resolve(args.model))
    c = loaded.config
    rows = []
    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        rows.append(bench_format(loaded, fmt, args))
        gc.collect()
        print(f"bench_engine: {level} {fmt} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    model = (f"model {c.name}: {c.num_layers} layers, hidden {c.hidden_size}, "
             f"{c.num_heads} heads / {c.num_kv_heads} KV heads x {c.head_dim}")
    return {"level": level, "model": model, "rows": rows}


def run_child(args, level: str) -> dict:
    """run_level in a fresh interpreter whose aten starts at `level`."""
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", args.model, "--one-level", "--json",
           "--formats", args.formats, "--prompt-len", str(args.prompt_len), "--context", str(args.context),
           "--batches", args.batches, "--decode-steps", str(args.decode_steps),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--kv-dtype", args.kv_dtype,
           "--device", args.device]
    if getattr(args, "prefill_lens", None):
        cmd += ["--prefill-lens", args.prefill_lens]
    if getattr(args, "prompt_only", False):
        cmd.append("--prompt-only")
    env = native.level_env(level, worker_env(args.threads))
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])[0]
    if result["level"] != level:  # aten ignored the request (e.g. a CPU without it)
        raise SystemExit(f"asked for dispatch level {level}, the child ran {result['level']}")
    return result


def resolve(model: str) -> Path:
    from common.model_store import default_store

    return default_store().resolve(model)


def pick_levels(spec: str | None) -> list[str]:
    """Levels to run, the host's own first. Only levels up to the host's can run here."""
    host = native.dispatch_level()
    supported = native.LEVELS[: native.LEVELS.index(host) + 1]
    if spec is None:
        return [host] + (["avx2"] if "avx2" in supported and host != "avx2" else [])
    wanted = list(reversed(supported)) if spec == "all" else spec.split(",")
    bad = [lvl for lvl in wanted if lvl not in supported]
    if bad:
        raise SystemExit(f"dispatch levels {bad} not available here; this host supports {list(supported)}")
    return wanted


def cpu_summary() -> str:
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first CPU's; all cores are alike
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name") or platform.processor() or "unknown"
    return f"cpu: {name}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS)


def print_report(levels: list[dict], args, copy_gb_s: float) -> None:
    print(levels[0]["model"])
    print(f"prefill: one {args.prompt_len}-token prompt, median of {args.repeats}; "
          f"decode: context {args.context}, median of {args.decode_steps} steps; KV cache {args.kv_dtype}")
    print()
    print(f"{'level':8} {'format':7} {'prefill tok/s':>13} {'batch':>5} {'decode tok/s':>12} {'x b=1':>6} "
          f"{'weights MB':>10} {'KV MB':>7} {'GB/s':>6} {'x copy':>6}")
    for lv in levels:
        for r in lv["rows"]:
            if not r["decode"]:  # --prompt-only
                print(f"{lv['level']:8} {r['format']:7} {r['prefill_tok_s']:13.1f} {'-':>5} {'-':>12} {'-':>6} "
                      f"{r['weight_bytes'] / 1e6:10.1f}")
                continue
            base = r["decode"][0]["batch"] / r["decode"][0]["step_s"]
            for i, d in enumerate(r["decode"]):
                tok_s = d["batch"] / d["step_s"]
                gb_s = (r["weight_bytes"] + d["kv_bytes"]) / d["step_s"] / 1e9
                prefill = f"{r['prefill_tok_s']:13.1f}" if i == 0 else " " * 13
                print(f"{lv['level']:8} {r['format']:7} {prefill} {d['batch']:5d} {tok_s:12.1f} {tok_s / base:6.2f} "
                      f"{r['weight_bytes'] / 1e6:10.1f} {d['kv_bytes'] / 1e6:7.1f} {gb_s:6.2f} {gb_s / copy_gb_s:6.2f}")
    for lv in levels:
        first = lv["rows"][0]
        for r in lv["rows"][1:]:
            decode = ", ".join(f"b={d['batch']} x{b['step_s'] / d['step_s']:.2f}"
                               for d, b in zip(r["decode"], first["decode"]))
            print(f"{lv['level']} {r['format']} vs {first['format']}: "
                  f"prefill x{r['prefill_tok_s'] / first['prefill_tok_s']:.2f}"
                  + (f", decode {decode}" if decode else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4,w8a8")
    parser.add_argument("--levels", default=None, help="comma-separated dispatch levels, or 'all'")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence when decoding")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-lens", default=None, metavar="N,N,...",
                        help="more prompt lengths to time one prefill pass of (JSON rows' prefill_points)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-dtype", choices=("fp32", "bf16"), default="fp32", help="KV cache element type")
    parser.add_argument("--kernels", action="store_true", help="run the kernel micro-benchmarks first")
    parser.add_argument("--one-level", action="store_true", help="run this process's dispatch level only, in process")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--prompt-only", action="store_true",
                        help="pack and time as a prefill worker does: prompt-pass layouts, no decode; "
                             "'auto' among --formats is the format its --prefill-quant auto picks here")
    add_device_flags(parser)
    args = parser.parse_args(argv)
    try:
        args.device = str(resolve_device(args.device).torch_device)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device != "cpu":
        args.one_level = True  # aten's CPU dispatch levels do not apply on a GPU
    try:
        parse_lens(args.prefill_lens)
    except ValueError as exc:
        parser.error(str(exc))
    if AUTO_FORMAT in args.formats.split(",") and not args.prompt_only:
        parser.error(f"--formats {AUTO_FORMAT}: a prefill format, resolved as a prefill worker resolves "
                     "it; add --prompt-only")
    configure_process(args.threads)
    if args.kernels:
        for module in ("benchmarks.bench_linear", "benchmarks.bench_attention"):
            subprocess.run([sys.executable, "-m", module, "--quick"], check=True)
            print()
    if args.json:
        levels = [run_level(args)] if args.one_level else [run_child(args, lvl) for lvl in pick_levels(args.levels)]
        print(json.dumps(levels))
        return
    print(cpu_summary())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    copy_gb_s = copy_bandwidth(device=args.device)
    print(f"copy bandwidth: {copy_gb_s:.2f} GB/s on {args.device} (dst.copy_(src), 256 MB fp32, "
          f"read+write, best of 5)", flush=True)
    levels = [run_level(args)] if args.one_level else [run_child(args, lvl) for lvl in pick_levels(args.levels)]
    print_report(levels, args, copy_gb_s)


if __name__ == "__main__":
    main()
