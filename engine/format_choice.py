"""The prefill weight format `auto` stands for (the default `--prefill-quant`): picked by how much
of the host's memory the model's matrices take in each format, once the model's config is read.

    choose_prefill_format(config, mem_total_bytes) -> FormatChoice(format, reason)

    fp32   when its copy takes at most 1/12 of the host's memory   (SmolLM2-135M: 0.54 GB)
    bf16   else when its copy takes at most 1/3                    (a 1B: 2.1 GB; a 3B: 6.4 GB)
    w8a8   else                                                    (an 8B: 8 GB)

Why these: a host runs a prefill and a decode worker at least, each with its KV pool, and the
decode worker's int4 copy of an 8B model is ~4.7 GB, so on a 24 GB host an 8B model fits only if
prefill holds it in 8 bits. fp32 is kept where it costs little because it is the exact format
(W8A8 without calibration loses quality on SmolLM2-135M, README), and bf16 next because it
halves the bytes at a small rounding cost: measured on a Sapphire Rapids-class Xeon (AVX512-BF16)
with the random 1B LLaMA, bf16 prefill ran 2.55x fp32's tokens/s and w8a8 2.74x
(`python -m benchmarks.bench_engine MODEL --formats fp32,bf16,w8a8`). On a host without
AVX512-BF16, aten's bf16 GEMM is slower than fp32's; the rule is still by memory, since a
format that does not fit is no choice at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.model_config import ModelConfig

AUTO_FORMAT = "auto"
_FRACTIONS = (("fp32", 4, 12), ("bf16", 2, 3))  # (format, bytes per weight, 1/fraction of memory)


@dataclass(frozen=True)
class FormatChoice:
    format: str
    reason: str


def matrix_params(config: ModelConfig) -> int:
    """Weights in the matrices a weight format packs: every projection and the lm_head."""
    h, q, kv = config.hidden_size, config.q_size, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return config.num_layers * per_layer + config.vocab_size * h


def host_memory_bytes() -> int:
    """MemTotal of this host (or of its cgroup's limit where that is lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def choose_prefill_format(config: ModelConfig, mem_total_bytes: int) -> FormatChoice:
    if mem_total_bytes <= 0:
        raise ValueError(f"mem_total_bytes must be positive, got {mem_total_bytes}")
    params = matrix_params(config)
    gib = 1 << 30
    for fmt, width, fraction in _FRACTIONS:
        size = params * width
        if size * fraction <= mem_total_bytes:
            return FormatChoice(fmt, f"{fmt} copy {size / gib:.2f} GiB <= 1/{fraction} of "
                                     f"{mem_total_bytes / gib:.1f} GiB of memory")
    return FormatChoice("w8a8", f"a bf16 copy ({params * 2 / gib:.2f} GiB) would take more "
                                f"than 1/3 of {mem_total_bytes / gib:.1f} GiB of memory")
