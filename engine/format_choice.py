"""Weight formats chosen for the operator: the prefill format `auto` stands for, and the format
of each matrix under the int4 decode format.

    matrix_format(fmt, parts) -> str
    packs_parts_apart(fmt, parts) -> bool

int4 repacks Q4_0, Q4_1 and Q4_K blocks exactly (their 16 levels per group of 32 are int4's). A
matrix the file stores wider (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) is packed int8 instead: the file's
author kept it wide on purpose (llama.cpp's Q4_K_M keeps attn_v and half of ffn_down in Q6_K, and
falls back to Q5_0/Q8_0 for rows not a multiple of 256 wide), and squeezing it into 16 levels cost
what the file had kept. Measured on SmolLM2-135M quantized by llama-quantize to Q4_K_M (Q5_0
and Q8_0 for most matrices, its 576-wide rows), against the F16 it was made from
(`python -m benchmarks.quality Q4_K_M --reference F16 --formats fp32,int4,int8`): the file's own
fp32 +3.83% perplexity; every matrix in int4 +6.00%; int8 +3.66%. Under int8, Q6_K and Q8_0
matrices keep the file's own blocks where the native kernels run ("q6_k", and "q8_0" for rows a
multiple of 256 wide: kernels/quant_int8.py); the others are requantized per row. Float matrices (an F16 file)
stay in the format asked for: quantizing them is the operator's choice. A fused projection
(q|k|v, gate|up) whose parts the file stores in different types is packed part by part under
the decode formats (packs_parts_apart; kernels/linear.py stack_linear), each part in its own
format and exact layout: Q4_K_M's q and k stay Q4_K beside a Q6_K v. Elsewhere (a prefill
format) the parts are joined as floats and take the widest part's format.

The prefill weight format `auto` stands for (the default `--prefill-quant`): picked by how much
of the host's memory the model's matrices take in each format, once the model's config is read.

    choose_prefill_format(config, mem_total_bytes, int4_tiles=False) -> FormatChoice(format, reason)
    choose_on_this_host(config, weights, device_type) -> FormatChoice   (the engine's call: this
        host's memory, its AMX tiles and bf16 speed, the file's block types)

    fp32   when its copy takes at most 1/12 of the host's memory (SmolLM2-135M: 0.54 GB), except
    int4   in its place when int4_tiles: the host runs int4 on AMX tiles (kernels/csrc/int4_amx.cpp)
           and every projection of the file is stored in a type int4 holds as it is (Q4_0, Q4_1,
           Q4_K, and Q6_K, a Q4_K_M file's attn_v and half of its ffn_down, in the "q6_kx" tile
           layout)
    bf16   in its place elsewhere when this host's bf16 GEMM is at least BF16_MIN_GAIN times as
           fast as its fp32 one at prompt sizes (bf16_prefill_faster: measured once per host)
    bf16   else when its copy takes at most 1/3                    (a 1B: 2.1 GB; a 3B: 6.4 GB)
    w8a8   else                                                    (an 8B: 8 GB)

Why int4 in fp32's place where the tiles run: it reads the file's own 4-bit values, exactly, with
the activations rounded to int16 per row (the arithmetic the int4 decode worker uses for every
later token), and on the tiles a prompt pass beats an fp32 GEMM: SmolLM2-135M's projections at
256 rows, one thread, a Sapphire Rapids class Xeon, 6.96 ms against 12.46; served
(`benchmarks.bench_peer --workloads chat8`, 8 clients, ~235-token prompts), TTFT p50 1.77 s
against fp32 prefill's 3.71 s, llama-server's 7.7-8.0 s. Its cost against fp32 weights and
activations, `python -m benchmarks.quality --formats fp32,int4` on SmolLM2-135M Q4_1: perplexity
+0.07%, greedy top-1 agreement 97.3% (its lm_head int8, as the decode worker's). Not in bf16's or
w8a8's place: there the tiles lose (they keep a float step per group of 32 weights and row, which
a bf16 or int8 GEMM does not). The random 1B LLaMA Q4_K_M, one 256-token prompt, one thread, the same host
(`python -m benchmarks.bench_engine MODEL --formats fp32,bf16,w8a8,int4 --batches 1 --prompt-len
256`): fp32 76.9 tok/s, int4 135.5, w8a8 233.4, bf16 282.1; served with int4 prefill, its
8-client long-prompt TTFT p50 was 15.4 s, against 3.2 s with bf16 at stop 38. Without the tiles int4's kernel at
prompt sizes is a dequantize and a GEMM per pass, slower than fp32's, so the rule is by memory.

Why bf16 in fp32's place where its GEMM is that much faster (CPUs with AVX512-BF16 and no AMX
tiles granted: AMD Zen 4, a Xeon VM that refuses the tiles): the prompt pass is most of a
chat's time to first token, and there it halves. Measured on an AMD EPYC (Zen 4, 2 cores, no
AMX), SmolLM2-135M Q4_1, one thread (`python -m benchmarks.bench_engine MODEL --formats
fp32,bf16 --prompt-len 256 --batches 1`): fp32 271 prompt tok/s, bf16 553; served
(`benchmarks.bench_peer --workloads chat8`, 8 clients, ~235-token prompts, one run each): TTFT
p50 6.06 s with fp32 prefill (0.67x llama-server's 9.0 s) and 2.32 s with bf16 (0.25x), output
64 and 108 tok/s; with this rule's bf16 and fp32 head, median of two rounds, 2.54 s (0.34x) and
106.5 tok/s. Its lm_head stays fp32 (one row per prompt, so little time): with a bf16 head
the default model answered "What is the capital of France?" with "L'Étoile, la Marseillaise,
la femme," where fp32, int4, w8a8 and bf16 layers with an fp32 head answer "The capital of
France is Paris." Its cost against fp32 (`python -m benchmarks.quality --formats fp32,bf16
--chunk 256`, prompt-sized passes, the bf16 head swapped for fp32's): perplexity +0.29%, greedy
top-1 agreement 99.0%; with the bf16 head +0.61% and 96.9%; int4 (the tiles' arithmetic) +0.04%
and 96.9%. Where bf16 is not that much faster
(an AVX2-only host, where aten's bf16 GEMM is slower than fp32's) fp32 stays.

w8a8 is the smallest prefill format; where it and the int4 decode copy would take more than
2/3 of memory together, the choice says so (`fits` False) and the engine logs it as a warning.

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

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.model_config import ModelConfig

AUTO_FORMAT = "auto"
_WIDE_GGUF_TYPES = frozenset(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"))
_DECODE_QUANTIZED = ("int8", "int4", "int4a8")  # formats that read GGUF blocks as stored
_FRACTIONS = (("fp32", 4, 12), ("bf16", 2, 3))  # (format, bytes per weight, 1/fraction of memory)


# Bytes per weight of the default int4 decode copy (4 bits plus a 16-bit scale and zero per
# group of 32), and the share of memory the two roles' copies may take together, the rest
# being the KV pools, the interpreters and whatever else the host runs.
_INT4_BYTES = 0.5625
_BOTH_COPIES_FRACTION = (2, 3)


@dataclass(frozen=True)
class FormatChoice:
    format: str
    reason: str
    fits: bool = True  # False: even w8a8 beside an int4 decode copy exceeds 2/3 of memory
    # The lm_head's format in the prompt-pass copy (None: the format's own, models/llama.py
    # LM_HEAD_FORMAT): fp32 beside bf16 picked for speed, whose bf16 head flipped first tokens.
    prompt_head: str | None = None


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


def projection_weights(weights: dict) -> int:
    """How many weights the decoder layers' matrices hold in all (what a decode step reads)."""
    return sum(math.prod(w.shape) for name, w in weights.items()
               if name.startswith("model.layers.") and len(w.shape) == 2)


def int4_native_projections(weights: dict) -> bool:
    """Whether every projection matrix (the decoder layers' 2-D weights) is stored in a GGUF type
    int4 holds as it is (kernels/quant_int4.py REPACKED_GGUF_TYPES) or Q6_K (Q4_K_M files keep
    attn_v and half of ffn_down in it), which a prompt-pass copy holds as stored in the AMX tile
    layout "q6_kx" wherever the tiles run (kernels/quant_q6_k.py default_layout)."""
    from kernels.quant_int4 import REPACKED_GGUF_TYPES

    mats = [w for name, w in weights.items() if name.startswith("model.layers.") and len(w.shape) == 2]
    held = set(REPACKED_GGUF_TYPES) | {"Q6_K"}
    return bool(mats) and all(getattr(w, "ggml_type", None) in held for w in mats)


def choose_prefill_format(config: ModelConfig, mem_total_bytes: int, int4_tiles: bool = False,
                          bf16_faster: Callable[[], bool] = lambda: False) -> FormatChoice:
    """int4_tiles: int4 runs on AMX tiles here and int4 holds every projection as stored;
    bf16_faster: asked only where fp32 would be chosen and the tiles do not take its place,
    whether bf16 GEMMs are fast enough here to take it instead (bf16_prefill_faster; module
    docstring)."""
    if mem_total_bytes <= 0:
        raise ValueError(f"mem_total_bytes must be positive, got {mem_total_bytes}")
    params = matrix_params(config)
    gib = 1 << 30
    for fmt, width, fraction in _FRACTIONS:
        size = params * width
        if size * fraction <= mem_total_bytes:
            fits = f"{fmt} copy {size / gib:.2f} GiB <= 1/{fraction} of {mem_total_bytes / gib:.1f} GiB of memory"
            if fmt == "fp32" and int4_tiles:
                return FormatChoice("int4", f"{fits}, and in fp32's place int4, as the file's projections "
                                            "are blocks int4 holds as stored and int4 runs on AMX tiles here")
            if fmt == "fp32" and bf16_faster():
                return FormatChoice("bf16", f"{fits}, and in fp32's place bf16 (its lm_head fp32), as this "
                                            f"host's bf16 GEMM measured at least {BF16_MIN_GAIN}x its fp32 one",
                                    prompt_head="fp32")
            return FormatChoice(fmt, fits)
    reason = (f"a bf16 copy ({params * 2 / gib:.2f} GiB) would take more than 1/3 of "
              f"{mem_total_bytes / gib:.1f} GiB of memory")
    both = params * (1 + _INT4_BYTES)
    num, den = _BOTH_COPIES_FRACTION
    if both * den > mem_total_bytes * num:
        # No prefill format is smaller than w8a8: say so at start-up rather than at the OOM killer.
        return FormatChoice("w8a8", f"{reason}; w8a8 is the smallest prefill format, and with an "
                                    f"int4 decode copy the two take {both / gib:.2f} GiB, more than "
                                    f"{num}/{den} of memory: this host is likely too small for the "
                                    f"model", fits=False)
    return FormatChoice("w8a8", f"{reason}; w8a8 and an int4 decode copy take {both / gib:.2f} GiB")


def choose_on_this_host(config: ModelConfig, weights: dict, device_type: str = "cpu") -> FormatChoice:
    """The prefill format `auto` stands for with this model's weights on this host, as
    LLMEngine.from_path resolves it (benchmarks.bench_engine --prompt-only times the same
    choice): int4 in fp32's place only on a CPU whose AMX tiles run and where the native
    kernels hold every projection as stored; bf16's speed asked only of a CPU."""
    from kernels import native

    cpu = device_type == "cpu"
    tiles = cpu and native.available() and native.amx_available() and int4_native_projections(weights)
    return choose_prefill_format(config, host_memory_bytes(), int4_tiles=tiles,
                                 bf16_faster=bf16_prefill_faster if cpu else (lambda: False))


# How much faster a prompt-sized bf16 GEMM must be than fp32's for bf16 to take fp32's place: it
# rounds every weight and activation to 8 significant bits (+0.29% perplexity on the default
# model, its head kept fp32), which a small gain would not pay for. Measured ratios: 2.04x (AMD Zen 4, whole prompt
# passes), 2.55x (Sapphire Rapids class, the 1B); below 1 on AVX2-only hosts.
BF16_MIN_GAIN = 1.5
# The timed GEMM: SmolLM2-135M's gate_proj (1536 x 576) over a 256-token prompt.
_PREFILL_GEMM = (256, 1536, 576)


def bf16_prefill_faster() -> bool:
    """Whether this host's bf16 GEMM at prompt sizes is at least BF16_MIN_GAIN times as fast as
    fp32's: timed once per host and remembered beside the kernel layouts
    (kernels/layout_choice.py: keyed by CPU, torch, dispatch level and thread count)."""
    from kernels.layout_choice import fastest_layout

    return fastest_layout("prefill-float", ["fp32", "bf16"], _weighed_prefill_time) == "bf16"


def _weighed_prefill_time(fmt: str) -> float:
    """Seconds per prompt-sized GEMM in `fmt`; bf16's times BF16_MIN_GAIN, so it wins only by
    that much."""
    return time_prefill_gemm(fmt) * (BF16_MIN_GAIN if fmt == "bf16" else 1.0)


def time_prefill_gemm(fmt: str, reps: int = 3) -> float:
    """Best of `reps` timings of one prompt-sized projection packed in `fmt`, through the same
    kernels.linear path a prompt pass takes."""
    import torch

    from kernels.linear import linear, pack_linear

    rows, out_features, in_features = _PREFILL_GEMM
    g = torch.Generator().manual_seed(0)
    packed = pack_linear(torch.randn(out_features, in_features, generator=g), None, fmt)
    x = torch.randn(rows, in_features, generator=g)
    linear(x, packed)  # warm-up: oneDNN builds its kernels on the first call
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        linear(x, packed)
        best = min(best, time.perf_counter() - t0)
    return best


def matrix_format(fmt: str, parts: list) -> str:
    """The format one matrix (the concatenation of `parts`: tensors or GGUF QuantizedTensors)
    is packed in when the model's format is `fmt` (module docstring)."""
    if fmt in ("int4", "int4a8") and any(getattr(p, "ggml_type", None) in _WIDE_GGUF_TYPES for p in parts):
        return "int8"
    return fmt


def packs_parts_apart(fmt: str, parts: list) -> bool:
    """Whether a fused projection's parts (GGUF QuantizedTensors of more than one type) are
    packed one by one under `fmt` rather than joined (module docstring)."""
    types = {getattr(p, "ggml_type", None) for p in parts}
    return fmt in _DECODE_QUANTIZED and len(types) > 1 and None not in types
