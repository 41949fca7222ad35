"""Micro-benchmark: paged attention (decode, prefill, mixed) and the KV-cache write.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_attention [--quick]

Prints per shape the time per call and the achieved GB/s (decode and KV write are memory
bound: bytes = K/V read or written) or GFLOP/s (prefill: 4 * D flops per visible (query, key)
pair per head), next to the machine's own limits measured in the same run (a large copy for
bandwidth, a large matmul for FLOP/s). On the CPU, decode is measured the way the model runs
it (fp32 q over an fp32 or bf16 cache, the plan built once per pass): the native kernel
(kernels/csrc/paged_decode.cpp, K/V read in place; the CPU path's default) at every native
level this host runs, the torch fallback it replaced (batched gather + matmul), per-sequence
SDPA and the reference; on a GPU it measures the Triton kernels instead.

On the CPU, glibc's malloc hands every large temporary (a gathered K/V, some MB) back to the
OS and page-faults it in again on the next call; that costs up to half of a torch-path decode
step (the native decode allocates nothing that size). The
serving process should keep freed memory, e.g. MALLOC_MMAP_THRESHOLD_=2147483647
MALLOC_TRIM_THRESHOLD_=4294967295 in its environment (or jemalloc / tcmalloc); run this
benchmark both ways to see the difference.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from kernels import native
from kernels.attention import paged_attention_cpu, paged_attention_reference, plan_paged_attention
from kernels.flash_attention import gather_sequence_kv
from kernels.kv_cache_write import write_kv_cache_cpu
from kernels.paged_attention import native_decode_supported, paged_decode_native, paged_decode_torch

# (name, Hq, Hkv, D): the default model's attention, and a LLaMA-3-8B layer.
SHAPES = [("smollm2-135m", 9, 3, 64), ("llama3-8b", 32, 8, 128)]
BLOCK_SIZE = 16


def timeit(fn, min_time: float = 0.2, max_iters: int = 200) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < min_time or len(times) < 3):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def make_batch(q_lens, seq_lens, hq, hkv, d, dtype, device):
    """A ragged batch over a cache whose blocks are handed out in shuffled order."""
    g = torch.Generator().manual_seed(0)
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n]
        used += n
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, cu, lens, tables))


def decode_per_sequence_sdpa(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """The candidate the CPU decode path was measured against: one SDPA call per sequence."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, seq_len in enumerate(seq_lens.tolist()):
        row = int(cu_seqlens_q[b])
        keys = gather_sequence_kv(k_cache, block_tables, [b], seq_len)[0].transpose(0, 1)
        values = gather_sequence_kv(v_cache, block_tables, [b], seq_len)[0].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[row:row + 1].transpose(0, 1), keys, values,
                                           scale=scale, enable_gqa=group > 1)
        out[row] = o.transpose(0, 1)[0]
    return out


def visible_pairs(q_lens, seq_lens) -> int:
    return sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))


def machine_limits(device) -> tuple[float, float]:
    """(copy GB/s counting read + write, fp32 matmul GFLOP/s) measured here."""
    src = torch.empty(64 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src))
    a = torch.randn(1024, 1024, device=device)
    t_mm = timeit(lambda: a @ a)
    return 2 * src.numel() * 4 / t / 1e9, 2 * 1024**3 / t_mm / 1e9


def report(label: str, seconds: float, amount: float, unit: str, limit: float) -> None:
    print(f"  {label:<44} {seconds * 1e3:9.3f} ms  {amount / seconds / 1e9:8.2f} {unit}"
          f"  ({100 * amount / seconds / 1e9 / limit:5.1f}% of limit)")


def native_levels() -> list[str]:
    """The native levels this host runs and can build (dispatch level first)."""
    levels = []
    for level in reversed(native.LEVELS[:native.LEVELS.index(native.dispatch_level()) + 1]):
        try:
            native.library(level)
            levels.append(level)
        except native.NativeUnavailable as e:
            print(f"  (native level {level} unavailable: {str(e).splitlines()[0]})")
    return levels


def bench_decode(device, dtype, quick, gbs):
    print(f"\ndecode (q_len 1), {dtype} cache, block_size {BLOCK_SIZE}: GB/s of K/V read")
    contexts = [128, 1024] if quick else [128, 512, 1024, 4096]
    levels = native_levels() if device.type == "cpu" else []
    for name, hq, hkv, d in SHAPES:
        for batch in (1, 8):
            for context in contexts:
                args = make_batch([1] * batch, [context] * batch, hq, hkv, d, dtype, device)
                scale = d ** -0.5
                nbytes = 2 * batch * context * hkv * d * args[1].element_size()
                tag = f"{name} B={batch} ctx={context}"
                if device.type == "cuda":
                    from kernels.paged_attention import paged_decode_triton
                    report(f"{tag} triton", timeit(lambda: paged_decode_triton(*args, scale)),
                           nbytes, "GB/s", gbs)
                    continue
                # As the model runs it: fp32 q (its residual stream) whatever the cache dtype,
                # the plan built once per pass and shared by all layers.
                q, k_cache, v_cache = args[0].float(), args[1], args[2]
                plan = plan_paged_attention(*args[3:], BLOCK_SIZE).decode
                out = torch.empty_like(q)
                if native_decode_supported(q, k_cache, v_cache, out):
                    for level in levels:
                        fn = lambda: paged_decode_native(q, k_cache, v_cache, plan, scale,  # noqa: E731
                                                         out, level)
                        report(f"{tag} native {level}", timeit(fn), nbytes, "GB/s", gbs)
                fn = lambda: paged_decode_torch(q, k_cache, v_cache, plan, scale, out)  # noqa: E731
                report(f"{tag} torch (batched gather+matmul)", timeit(fn), nbytes, "GB/s", gbs)
                report(f"{tag} per-seq sdpa",
                       timeit(lambda: decode_per_sequence_sdpa(*args, scale)), nbytes, "GB/s", gbs)
                if context <= 1024 and not quick:
                    report(f"{tag} reference",
                           timeit(lambda: paged_attention_reference(*args, scale), max_iters=5),
                           nbytes, "GB/s", gbs)


def bench_prefill(device, dtype, quick, flops_limit):
    print(f"\nprefill, {dtype}: GFLOP/s (4 * D per visible pair per head)")
    cases = [("fresh 128", [128], [128]), ("fresh 512", [512], [512]),
             ("4 x fresh 128", [128] * 4, [128] * 4),
             ("chunk 256 after 768 prefix", [256], [1024]),
             ("mixed: 8 decodes ctx 512 + chunk 256/1024", [1] * 8 + [256], [512] * 8 + [1024])]
    if quick:
        cases = cases[:1] + cases[3:4]
    for name, hq, hkv, d in SHAPES:
        for label, q_lens, seq_lens in cases:
            args = make_batch(q_lens, seq_lens, hq, hkv, d, dtype, device)
            scale = d ** -0.5
            flops = 4 * d * hq * visible_pairs(q_lens, seq_lens)
            if device.type == "cuda":
                from kernels.flash_attention import flash_attention_triton
                report(f"{name} {label} triton",
                       timeit(lambda: flash_attention_triton(*args, scale)),
                       flops, "GFLOP/s", flops_limit)
            else:
                report(f"{name} {label} cpu", timeit(lambda: paged_attention_cpu(*args, scale)),
                       flops, "GFLOP/s", flops_limit)
                if not quick and sum(q_lens) <= 512:
                    report(f"{name} {label} reference",
                           timeit(lambda: paged_attention_reference(*args, scale), max_iters=5),
                           flops, "GFLOP/s", flops_limit)


def bench_kv_write(device, dtype, quick, gbs):
    print(f"\nKV-cache write, {dtype}: GB/s (K and V read + written)")
    for name, _, hkv, d in SHAPES:
        for tokens in (8, 512):
            k = torch.randn(tokens, hkv, d, device=device).to(dtype)
            v = torch.randn_like(k)
            num_blocks = 4 * tokens // BLOCK_SIZE + 4
            k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, device=device, dtype=dtype)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]
            nbytes = 4 * k.numel() * k.element_size()
            if device.type == "cuda":
                from kernels.kv_cache_write import write_kv_cache_triton
                fn = lambda: write_kv_cache_triton(k, v, k_cache, v_cache, slots)  # noqa: E731
                report(f"{name} T={tokens} triton", timeit(fn), nbytes, "GB/s", gbs)
            else:
                fn = lambda: write_kv_cache_cpu(k, v, k_cache, v_cache, slots)  # noqa: E731
                report(f"{name} T={tokens} cpu", timeit(fn), nbytes, "GB/s", gbs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    gbs, gflops = machine_limits(device)
    print(f"device {device}, torch threads {torch.get_num_threads()}: copy {gbs:.1f} GB/s, "
          f"fp32 matmul {gflops:.1f} GFLOP/s (the limits below)")
    for dtype in (torch.float32, torch.bfloat16):
        bench_decode(device, dtype, args.quick, gbs)
        bench_prefill(device, dtype, args.quick, gflops)
        bench_kv_write(device, dtype, args.quick, gbs)


if __name__ == "__main__":
    main()
