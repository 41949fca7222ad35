"""Single-process engine benchmark: prefill and decode speed of one model, per weight format,
in one run so the figures compare.

    python -m deploy.bench_engine [MODEL] [--formats fp32,bf16,int8,int4,w8a8] [--prompt-len 512]
                                  [--decode-steps 32] [--kernels]

Prints, per format: prefill tokens/s for one prompt of --prompt-len tokens in a single pass,
and decode tokens/s at batch 1 and batch 8 (every sequence one token per step, context
--prompt-len), with the weight bytes each decode step must read and the bandwidth that implies.
Runs with one torch thread unless --threads says otherwise. --kernels first runs the kernel
micro-benchmarks (kernels.bench_linear, kernels.bench_attention: per op and shape, time and
GB/s or GFLOP/s next to this machine's measured copy bandwidth and GEMM peaks), so one command
prints kernels and end-to-end decode speed per format together.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from engine.config import CacheConfig
from engine.loaders import load_model
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from engine.runtime import configure_process


def weight_bytes(model) -> int:
    total = 0
    for layer in model.layers:
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            total += sum(t.numel() * t.element_size() for t in (lin.weight, lin.scales, lin.zeros) if t is not None)
    head = model.lm_head
    return total + head.weight.numel() * head.weight.element_size()


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_format(loaded, fmt: str, prompt_len: int, decode_steps: int, repeats: int) -> dict:
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, fmt)
    bs = 16
    blocks_per_seq = (prompt_len + decode_steps + 1 + bs - 1) // bs
    runner = ModelRunner(model, CacheConfig(block_size=bs, num_blocks=8 * blocks_per_seq))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, loaded.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(8)]
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(8)]

    prefill_s = time_it(lambda: runner.execute([SequenceChunk(prompts[0], 0, tables[0], True)]), repeats)
    for i in range(1, 8):  # fill the other sequences' caches for the batch-8 decode
        runner.execute([SequenceChunk(prompts[i], 0, tables[i], True)])

    def decode(batch: int) -> float:
        def steps():
            for s in range(decode_steps):
                runner.execute([SequenceChunk([42], prompt_len + s, tables[i], True) for i in range(batch)])
        return time_it(steps, 1) / decode_steps

    d1, d8 = decode(1), decode(8)
    wbytes = weight_bytes(model)
    return {"format": fmt, "prefill_tok_s": prompt_len / prefill_s, "decode1_tok_s": 1 / d1,
            "decode8_tok_s": 8 / d8, "weight_mb": wbytes / 1e6, "decode1_gb_s": wbytes / d1 / 1e9}


def main(argv: list[str] | None = None) -> None:
    from engine.model_store import ModelStore, default_home

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4,w8a8")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernels", action="store_true", help="run the kernel micro-benchmarks first")
    args = parser.parse_args(argv)
    if args.kernels:
        for module in ("kernels.bench_linear", "kernels.bench_attention"):
            subprocess.run([sys.executable, "-m", module, "--quick"], check=True)
            print()
    configure_process(args.threads)
    path = ModelStore(default_home()).resolve(args.model)
    loaded = load_model(path)
    print(f"model {loaded.config.name}: {loaded.config.num_layers} layers, hidden {loaded.config.hidden_size}; "
          f"threads={torch.get_num_threads()}, prompt {args.prompt_len} tokens")
    print(f"{'format':8} {'prefill tok/s':>14} {'decode b=1 tok/s':>17} {'decode b=8 tok/s':>17} "
          f"{'weights MB':>11} {'b=1 GB/s':>9}")
    rows = [bench_format(loaded, fmt, args.prompt_len, args.decode_steps, args.repeats)
            for fmt in args.formats.split(",")]
    for r in rows:
        print(f"{r['format']:8} {r['prefill_tok_s']:14.1f} {r['decode1_tok_s']:17.1f} {r['decode8_tok_s']:17.1f} "
              f"{r['weight_mb']:11.1f} {r['decode1_gb_s']:9.2f}")
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['format']} vs {base['format']}: prefill x{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}, "
              f"decode b=1 x{r['decode1_tok_s'] / base['decode1_tok_s']:.2f}, "
              f"decode b=8 x{r['decode8_tok_s'] / base['decode8_tok_s']:.2f}")


if __name__ == "__main__":
    main()
