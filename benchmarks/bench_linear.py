"""Micro-benchmark of the linear formats and the small elementwise kernels on this machine.

    python -m benchmarks.bench_linear [--threads 1] [--quick]

Every number is printed next to this machine's own limits, measured in the same run:
memory bandwidth (a large tensor copy, read + write bytes) for decode GEMVs (M = 1, 8), and the
dense fp32 / bf16 matmul and int8 torch._int_mm peaks for prefill GEMMs (M = 512).
Shapes are the default model's (SmolLM2-135M: hidden 576, intermediate 1536, q/o 576x576,
k/v 192x576, vocab 49152, 30 layers). The lm_head is timed at decode M only: prefill needs the
logits of the last token alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from kernels.activation import silu_and_mul
from kernels.linear import PackedLinear, linear, pack_linear, packed_nbytes
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary
from worker.runtime import configure_process

HIDDEN, INTER, KV, VOCAB, LAYERS, HEAD_DIM = 576, 1536, 192, 49152, 30, 64
# (name, N = out_features, K = in_features, count per token)
SHAPES = [
    ("q_proj", HIDDEN, HIDDEN, LAYERS), ("k_proj", KV, HIDDEN, LAYERS), ("v_proj", KV, HIDDEN, LAYERS),
    ("o_proj", HIDDEN, HIDDEN, LAYERS), ("gate_proj", INTER, HIDDEN, LAYERS), ("up_proj", INTER, HIDDEN, LAYERS),
    ("down_proj", HIDDEN, INTER, LAYERS), ("lm_head", VOCAB, HIDDEN, 1),
]
FMTS = ["fp32", "bf16", "int8", "int4", "w8a8"]


def bench(fn: Callable[[], object], min_time: float = 0.15, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` timed batches of at least min_time / repeats each."""
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def machine_limits(quick: bool) -> dict[str, float]:
    size = (64 if quick else 256) << 20
    src, dst = torch.empty(size, dtype=torch.uint8).random_(), torch.empty(size, dtype=torch.uint8)
    limits = {"GB/s": 2 * size / bench(lambda: dst.copy_(src)) / 1e9}
    n = 1024 if quick else 2048
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        limits[name] = 2 * n**3 / bench(lambda: a @ b, min_time=0.5) / 1e9
    a8 = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b8 = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    limits["int8"] = 2 * n**3 / bench(lambda: torch._int_mm(a8, b8), min_time=0.5) / 1e9
    return limits


def bench_linear(limits: dict[str, float], ms: list[int]) -> None:
    """One row per (shape, M); one weight matrix per shape, so small ones are cache-resident
    (GB/s above the DRAM copy bandwidth means the weights came from cache)."""
    peak_for = {"fp32": "fp32", "bf16": "bf16", "int8": "bf16", "int4": "bf16", "w8a8": "int8"}
    print(f"\n{'op':<10}{'M':>5}{'N':>7}{'K':>6} | " + " | ".join(f"{f:>22}" for f in FMTS))
    print(" " * 29 + "| " + " | ".join(f"{'us  GB/s|GF/s  %lim':>22}" for _ in FMTS))
    g = torch.Generator().manual_seed(0)
    for name, n, k, _ in SHAPES:
        w = torch.randn(n, k, generator=g) / k**0.5
        packs = {f: pack_linear(w, None, f) for f in FMTS}
        for m in ms:
            if m > 64 and name == "lm_head":
                continue
            x = torch.randn(m, k, generator=g)
            cells = []
            for f in FMTS:
                t = bench(lambda: linear(x, packs[f]))
                if m <= 8:  # bandwidth-bound: weights + activations in and out
                    rate = (packed_nbytes(packs[f]) + 4 * m * (n + k)) / t / 1e9
                    pct = 100 * rate / limits["GB/s"]
                else:  # compute-bound
                    rate = 2 * m * n * k / t / 1e9
                    pct = 100 * rate / limits[peak_for[f]]
                cells.append(f"{t * 1e6:8.1f} {rate:6.1f} {pct:5.0f}%")
            print(f"{name:<10}{m:>5}{n:>7}{k:>6} | " + " | ".join(cells))


def bench_decode_step(limits: dict[str, float], ms: list[int]) -> None:
    """All linears of one decode step over the model's real working set (every layer its own
    weights, so nothing stays in cache as it does in the per-op table above)."""
    print("\nSmolLM2-135M decode step, all linear layers (30 layers x 7 projections + lm_head),"
          " every layer its own weights:")
    g = torch.Generator().manual_seed(1)
    for f in FMTS:
        layers = []
        for name, n, k, count in SHAPES:
            for _ in range(count):
                layers.append(pack_linear(torch.randn(n, k, generator=g) / k**0.5, None, f))
        nbytes = sum(packed_nbytes(p) for p in layers)
        for m in ms:
            xs = {k: torch.randn(m, k, generator=g) for k in (HIDDEN, INTER)}

            def step() -> None:
                for p in layers:
                    linear(xs[p.in_features], p)

            t = bench(step, min_time=1.0, repeats=3)
            rate = nbytes / t / 1e9
            print(f"  {f:<5} M={m}: weights {nbytes / 2**20:6.1f} MiB, {t * 1e3:7.2f} ms/step, {rate:5.1f} GB/s"
                  f" ({100 * rate / limits['GB/s']:3.0f}% of copy bw) -> {m / t:6.0f} tokens/s from the linears")
        del layers


def bench_elementwise(limits: dict[str, float], ms: list[int]) -> None:
    print(f"\n{'elementwise op':<28}{'M':>5} {'us':>9} {'GB/s':>7} {'%bw':>5}")
    for m in ms:
        x, r, wn = torch.randn(m, HIDDEN), torch.randn(m, HIDDEN), torch.ones(HIDDEN)
        t = bench(lambda: rms_norm(x, wn, 1e-5, r))
        rows = [("rms_norm+residual [M,576]", t, 4 * m * HIDDEN * 4)]
        gu = torch.randn(m, 2 * INTER)
        t = bench(lambda: silu_and_mul(gu))
        rows.append(("silu_and_mul [M,3072]", t, 4 * m * INTER * 3))
        q, kk = torch.randn(m, 9, HEAD_DIM), torch.randn(m, 3, HEAD_DIM)
        pos = torch.arange(m)
        cos, sin = torch.randn(8192, HEAD_DIM // 2), torch.randn(8192, HEAD_DIM // 2)
        t = bench(lambda: apply_rotary(q, kk, pos, cos, sin))
        rows.append(("rope q9/kv3 heads, D=64", t, 4 * m * 12 * HEAD_DIM * 2 + 8 * m * HEAD_DIM))
        for label, t, nbytes in rows:
            rate = nbytes / t / 1e9
            print(f"{label:<28}{m:>5} {t * 1e6:9.1f} {rate:7.2f} {100 * rate / limits['GB/s']:4.0f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and native-kernel threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="smaller peak probes, decode M only")
    args = parser.parse_args()
    configure_process(args.threads)
    ms = [1, 8] if args.quick else [1, 8, 512]
    limits = machine_limits(args.quick)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"machine limits: copy bandwidth {limits['GB/s']:.1f} GB/s; matmul peak fp32 {limits['fp32']:.0f}, "
          f"bf16 {limits['bf16']:.0f}, int8 (_int_mm) {limits['int8']:.0f} GFLOP/s")
    print("columns per format: time (us), then GB/s for M <= 8 (bandwidth-bound, % of copy bandwidth)"
          " or GFLOP/s for M = 512 (% of that dtype's matmul peak; weight-only formats vs bf16)")
    bench_linear(limits, ms)
    bench_decode_step(limits, [m for m in ms if m <= 8])
    bench_elementwise(limits, [1, 512] if not args.quick else [1])


if __name__ == "__main__":
    main()
