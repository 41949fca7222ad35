"""Weight-only int4 linear, group-wise asymmetric (group 32): the compact decode format.

Convention (torchao / gpt-fast "tinygemm"; verified against the CPU kernel by experiment):

    w[n, k] ~= (q[n, k] - 8) * scale[g, n] + zero[g, n],   q in 0..15,   g = k // 32
    scales_and_zeros: bf16 [K/32, N, 2], the last axis (scale, zero)

Centring q on 8 keeps `zero` near the group's midpoint (small, so bf16 rounds it finely).

GGUF repack, integer to integer (the nibbles are copied, never rounded through floats):

    Q4_0 block: fp16 d, 16 bytes     w = d * (q - 8)   ->  scale = d, zero = 0
    Q4_1 block: fp16 d, fp16 m, 16B  w = d * q + m     ->  scale = d, zero = m + 8 d  (fp32, exact)
    Q4_K sub-block of 32:            w = s * q - mn    ->  scale = s, zero = 8 s - mn   (s = d * sc,
                                                            mn = dmin * min: kernels/ggml_dequant.py)
    nibbles: element i < 16 of a block is the low nibble of byte i, element 16 + i the high one.
    (Q4_K's groups are the same 16 levels of a group of 32, so its q are copied too; only the
    "q4_1" layout then rounds s and -mn to fp16, a relative 2^-11, far below a requantization's
    half a step per weight.)

In the "cpu" and "nibbles" layouts only scale and zero are rounded (to bf16); the result equals
QuantizedTensor.dequantize() up to that rounding. The "q4_1" layout of a Q4_1 GGUF is exact.

Layouts (PackedLinear.layout), chosen by the device given to pack():
    "q4_1":    ggml Q4_1's values in three arrays: weight uint8 [N, Kp / 2] (ggml's nibble
               bytes, byte i of a group = q_i | q_{16+i} << 4, reordered within chunks of 16
               groups so that the kernel scales 16 groups' integer dots at once:
               to_chunk_order), scales fp16 d [N, Kp / 32], zeros fp16
               m [N, Kp / 32], w = q * d + m (so (scale, zero) = (d, m + 8 d)). A Q4_1 GGUF is
               split with its bytes unchanged, Q4_0 with m = -8 d (exact); float weights are quantized
               with fp16 d and m. Read by the native CPU kernel (kernels/csrc/int4_linear.cpp,
               fp32 activations rounded to int16 per row inside the kernel).
    "q4_k":    a GGUF Q4_K matrix (K % 256 == 0) for the same native kernel: its nibbles in the
               "q4_1" layout's chunk order and its own scales, uint8 [2, N, K / 32] (6-bit sc
               and mn per group) and fp16 (d, dmin) [N, K / 256, 2], w = (d sc) q - dmin mn,
               decoded per weight row by the kernel (tandem_q4k_linear). Exact: the "q4_1"
               layout would round d sc and dmin mn to fp16; and 4.625 bits a weight, not 5.
               ("q4_ka8": the same arrays under int4a8.) Where "q4_1" would be chosen, a Q4_K
               matrix takes it.
    "q4_1x":   the "q4_1" layout's values in AMX tile order, for kernels/csrc/int4_amx.cpp
               (x rounded to int16 per row exactly as for "q4_1", so the same integer dots, on
               AMX-INT8 tiles): weight uint8 [N, Kp / 2] holding, per block of 16 output rows
               and group, 256 bytes (to_tile_order), and d and m fp16 [N, Kp / 32] holding per
               block and group the 16 rows' values side by side. Needs N % 16 == 0 and a CPU and
               OS that grant AMX (native.amx_available); offered to the layout choice only there.
               ("q4_kx": a Q4_K matrix where "q4_1x" is chosen, its nibbles in the same tile
               order and its own scales as "q4_k" has them, in tile rows: exact.)
    "cpu":     aten._convert_weight_to_int4pack_for_cpu's blocked uint8 [Np, Kp/2] (internal to
               aten, so this module never decodes it by hand), run by _weight_int4pack_mm_for_cpu
               with bf16 activations. Measured (torch 2.13) limits: N % 16 == 0 and
               K % group == 0; N is padded to Np = round_up(N, 16) (zero rows, output sliced).
    "nibbles": uint8 [N, Kp/2], byte j of row n = q[n, 2j] | q[n, 2j+1] << 4. Read by the Triton
               kernel below; where Triton (or the aten CPU kernel) is missing, dequantized on the
               fly and multiplied densely in bf16.
Both pad K to Kp = round_up(K, 32) with zero weights (scale 0, zero 0).

Prefill on CPU should use w8a8: the CPU int4 kernel is tuned for few rows (measured ~2x slower
than a dense bf16 matmul at M = 512, and ~3x faster at M = 1).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kernels import batch_invariance, native
from kernels._triton import (HAS_TRITON, activation_dtype, gemm_tiles, record_launch, tl, triton, triton_layouts,
                             use_triton)
from kernels.ggml_dequant import k4_scales_mins, q4_k_groups, q4_k_q
from kernels.linear import PackedLinear, linear_reference, to_float
from kernels.quantized_tensor import QuantizedTensor

GROUP_SIZE = 32
# From this many rows on, dequantizing the layer and running the fp32 GEMM beats the native
# kernel, whose cost grows with rows (measured at N=3072, K=576, one core: native 2.6 ms vs
# dense 3.4 ms at 64 rows, 5.3 vs 4.6 at 128, 31 vs 13 at 512). A decode worker's steps and
# its 64-token local chunks stay below it.
NATIVE_DENSE_MIN_ROWS = 128
# The AMX tile layouts ("q4_1x", "q4_kx") have no cut-over: the tile kernel builds each weight
# tile once for all row tiles and stays ahead of the dense GEMM at every row count measured
# (SmolLM2-135M's four projection shapes, one thread, Sapphire Rapids class: 1.87 ms against
# fp32 GEMM's 3.81 at 64 rows, 6.96 against 12.46 at 256; the chunk layout's kernel 7.87 and
# 33.84).
N_ALIGN_CPU = 16
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
REPACKED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # int4 takes their integer q as they are
_HAS_CPU_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
    torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class Int4Groups(NamedTuple):
    """Device-independent int4 weights: w = (q - 8) * scales + zeros, per group of 32 along K."""

    q: torch.Tensor  # uint8 [N, Kp], values 0..15
    scales: torch.Tensor  # fp32 [N, Kp / 32]
    zeros: torch.Tensor  # fp32 [N, Kp / 32]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
    """Min-max asymmetric quantization of a float [N, K] matrix. scale and zero are rounded to
    bf16 first and q is computed against the rounded values, so the kernels' bf16 parameters
    are the ones q was fitted to."""
    n, k = w.shape
    w = F.pad(w.float(), (0, _round_up(k, group_size) - k)).reshape(n, -1, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.bfloat16).float()
    zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
    q = torch.round((w - zeros[..., None]) / scales[..., None] + 8.0).clamp(0, 15)
    return Int4Groups(q.to(torch.uint8).reshape(n, -1), scales, zeros)


def int4_from_gguf(qt: QuantizedTensor) -> Int4Groups:
    """Q4_0 / Q4_1 / Q4_K raw blocks -> Int4Groups, integer nibbles copied as is (see module
    docstring)."""
    if qt.ggml_type == "Q4_K":
        q, scale, minus = q4_k_groups(qt.data)
        zeros = np.float32(8.0) * scale - minus  # 8 s is exact; one rounding, as for Q4_1
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zeros))
    block_bytes = _GGUF_BLOCK_BYTES.get(qt.ggml_type)
    if block_bytes is None:
        raise ValueError(f"int4 repack needs {', '.join(REPACKED_GGUF_TYPES)} blocks, got {qt.ggml_type}")
    rows, cols = qt.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"GGUF row length {cols} is not a multiple of {GROUP_SIZE}")
    blocks = np.ascontiguousarray(qt.data).reshape(rows, cols // GROUP_SIZE, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, G]
    if qt.ggml_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + np.float32(8.0) * d  # 8d is exact; the sum is exact unless d and m differ by > 2^13
        qs = blocks[..., 4:]
    else:
        zeros = np.zeros_like(d)
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros))


def to_int4_groups(weight: torch.Tensor | QuantizedTensor) -> Int4Groups:
    if isinstance(weight, QuantizedTensor) and weight.ggml_type in REPACKED_GGUF_TYPES:
        return int4_from_gguf(weight)
    return quantize_int4(to_float(weight))


# What a whole decode step gains beyond the int4 kernel itself when its layers run in the
# native layout: engine/native_decode.py then runs every op of a decode pass in one native
# call, which aten's layout (a torch op) cannot join. Measured on a Sapphire Rapids class host,
# SmolLM2-135M, one pass of the same kernels either way: 1.44x at one thread (17.2 -> 11.3 ms
# a step, batch 1), 1.72x at two; the 1.07B LLaMA 1.10x. The layout choice divides the native
# kernel's measured time by this (the smallest model's margin, conservatively rounded down),
# so aten's kernel is chosen only where it is faster by more than the native path recovers:
# on that host aten's kernel was 1.26x faster than the native one at one thread, and the step
# with it 1.7x slower.
NATIVE_STEP_GAIN = 1.4


def default_layout(device: torch.device) -> str:
    """CUDA: "nibbles" (Triton). CPU: the faster of the native "q4_1" kernel and aten's
    "cpu" kernel on this host, measured once (kernels/layout_choice.py): aten's int4 GEMV is
    fast on some AVX-512 hosts and ~2 GB/s on AVX2-only ones; the native kernel's time counts
    NATIVE_STEP_GAIN less, for the native decode path it opens. Where AMX tiles are granted
    the tile layout is a third candidate, and the only one for layers that run prompt passes
    only (kernels/layout_choice.py prompt_passes): no other kernel comes near it there."""
    if device.type != "cpu" or triton_layouts(device):
        return "nibbles"
    from kernels.layout_choice import fastest_layout, runs_prompt_passes, streams_weights

    candidates = [name for name, ok in (("q4_1", native.available()), ("cpu", _HAS_CPU_KERNEL)) if ok]
    if "q4_1" in candidates and native.amx_available():
        if runs_prompt_passes():  # tiles built once a pass: ~2x an fp32 GEMM at 64-256 rows
            return AMX_LAYOUT
        candidates.append(AMX_LAYOUT)
    if not candidates:
        return "nibbles"
    if len(candidates) == 1:
        return candidates[0]

    # ~0.56 bytes a weight (4 bits, an fp16 scale and offset per 32) in either layout.
    if streams_weights(0.5625):
        return fastest_layout("int4", candidates, _time_streamed, variant="streamed")
    return fastest_layout("int4", candidates, _time_layout)


def _step_time(layout: str, seconds: tuple[float, ...]) -> tuple[float, ...]:
    """A kernel's measured times (per shape) as the layout choice weighs them (NATIVE_STEP_GAIN)."""
    gain = NATIVE_STEP_GAIN if layout in Q4_1_LAYOUTS + AMX_LAYOUTS else 1.0
    return tuple(t / gain for t in seconds)


def _time_layout(layout: str) -> tuple[float, ...]:
    """Seconds for one decode-shaped pass (a 1536 x 576 projection at M = 1 and M = 8), its
    weights in cache after the first (weighed by _step_time)."""
    return _step_time(layout, _time_passes(layout, 1536, 576, copies=1, reps=3))


def _time_streamed(layout: str) -> tuple[float, ...]:
    """Seconds for decode-shaped passes over 2048 x 2048 projections, as many distinct copies
    as fill twice the last-level cache, so each call reads its weights from memory."""
    from kernels.layout_choice import last_level_cache_bytes

    copies = -(-2 * last_level_cache_bytes() // int(2048 * 2048 * 0.5625))
    return _step_time(layout, _time_passes(layout, 2048, 2048, copies=min(copies, 1024), reps=1))


def _time_passes(layout: str, n: int, k: int, copies: int, reps: int) -> tuple[float, float]:
    from kernels.layout_choice import time_decode_passes

    packed = pack(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), None, torch.device("cpu"), layout)
    return time_decode_passes(packed, forward, copies, reps, warmups=3 if copies == 1 else 1)


def pack(weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, device: torch.device,
         layout: str | None = None, int8_activations: bool = False) -> PackedLinear:
    """int8_activations (the "int4a8" format): the "q4_1a8" layout where the native CPU kernels
    run; elsewhere (a GPU, no compiler) int4's own layout, weight-only, as the format's
    weights are int4's either way."""
    out_features, in_features = weight.shape
    if layout is None:
        if int8_activations and device.type == "cpu" and native.available():
            layout = "q4_1a8"
        layout = layout or default_layout(device)
        is_q4_k = isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q4_K"
        if layout == AMX_LAYOUT:
            if out_features % AMX_BLOCK:  # the tiles take blocks of 16 rows
                layout = "q4_1"
            elif is_q4_k:
                layout = Q4_K_AMX_LAYOUT  # its own scales, exactly, in tiles
        if layout in Q4_1_LAYOUTS and is_q4_k:
            layout = Q4_K_LAYOUTS[Q4_1_LAYOUTS.index(layout)]  # its own scales, exactly
    if layout == AMX_LAYOUT:
        return pack_q4_1x(q4_1_blocks(weight), in_features, bias)
    if layout in Q4_K_LAYOUTS + (Q4_K_AMX_LAYOUT,):
        return pack_q4_k(weight, bias, layout)
    if layout in Q4_1_LAYOUTS:
        return pack_q4_1(q4_1_blocks(weight), in_features, bias, layout)
    return pack_groups(to_int4_groups(weight), in_features, bias, device, layout)


BLOCK_BYTES = 20  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
# Layouts of the same three Q4_1 arrays, read by kernels/csrc/int4_linear.cpp with int16
# activations per row ("q4_1") or int8 per group of 32 ("q4_1a8", llama.cpp's arithmetic).
Q4_1_LAYOUTS = ("q4_1", "q4_1a8")
# A Q4_K matrix's nibbles in the same chunk order with its own scales (pack_q4_k), for the
# same tiles: int16 activations ("q4_k") or int8 per group ("q4_ka8").
Q4_K_LAYOUTS = ("q4_k", "q4_ka8")
# The "q4_1" values in AMX tile order (kernels/csrc/int4_amx.cpp), blocks of AMX_BLOCK rows.
AMX_LAYOUT = "q4_1x"
# A Q4_K matrix where "q4_1x" is chosen: its nibbles in the same tile order, its own scales
# (sc, mn, and per super-block d, dmin) in tile rows (pack_q4_k).
Q4_K_AMX_LAYOUT = "q4_kx"
AMX_LAYOUTS = (AMX_LAYOUT, Q4_K_AMX_LAYOUT)
AMX_BLOCK = 16
NATIVE_LAYOUTS = Q4_1_LAYOUTS + Q4_K_LAYOUTS + AMX_LAYOUTS
A8_LAYOUTS = ("q4_1a8", "q4_ka8")
_Q4_K_ROWS_PER_PASS = 1024  # rows repacked at a time: a large matrix's temporaries stay small
CHUNK_GROUPS = 16  # groups per chunk of the "q4_1" layout's nibbles (kernels/csrc/int4_linear.cpp)


def q4_1_blocks(weight: torch.Tensor | QuantizedTensor) -> np.ndarray:
    """uint8 [N, Kp / 32 * 20]: the weights as ggml Q4_1 blocks (module docstring)."""
    if isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q4_1":
        return np.ascontiguousarray(weight.data)
    if isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q4_0":
        rows, cols = weight.shape
        src = np.ascontiguousarray(weight.data).reshape(rows, cols // GROUP_SIZE, 18)
        d = src[..., 0:2].copy().view(np.float16)
        m = (d.astype(np.float32) * np.float32(-8.0)).astype(np.float16)  # exact: a power of two
        out = np.concatenate([src[..., 0:2], m.view(np.uint8), src[..., 2:]], axis=-1)
        return out.reshape(rows, -1)
    if isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q4_K":
        q, scale, minus = (torch.from_numpy(a) for a in q4_k_groups(weight.data))
        return _q4_1_from_groups(q, scale.to(torch.float16), (-minus).to(torch.float16))
    q, scales, zeros = to_int4_groups(weight)
    return _q4_1_from_groups(q, scales.to(torch.float16), (zeros - 8.0 * scales).to(torch.float16))


def _group_bytes(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, Kp] (0..15) -> ggml's group bytes [N, Kp / 32, 16]: byte i = q_i | q_{16+i} << 4."""
    qg = q.reshape(q.shape[0], -1, GROUP_SIZE)
    return qg[..., :16] | (qg[..., 16:] << 4)


def _q4_1_from_groups(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """q uint8 [N, Kp], fp16 d and m [N, Kp / 32] (w = q * d + m) -> Q4_1 blocks [N, G * 20]."""
    out = torch.cat([d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), _group_bytes(q)], dim=-1)
    return out.reshape(q.shape[0], -1).numpy()


def pack_q4_k(weight: QuantizedTensor, bias: torch.Tensor | None, layout: str = "q4_k") -> PackedLinear:
    """A Q4_K GGUF matrix -> the "q4_k" (or "q4_ka8") layout (module docstring): the integer q,
    sc and mn as the file has them, moved, never rounded."""
    if not isinstance(weight, QuantizedTensor) or weight.ggml_type != "Q4_K":
        raise ValueError(f"the {layout} layout takes Q4_K GGUF blocks, got "
                         f"{getattr(weight, 'ggml_type', type(weight).__name__)}")
    n, k = weight.shape
    tiles = layout == Q4_K_AMX_LAYOUT
    if tiles and n % AMX_BLOCK:
        raise ValueError(f"the {layout} layout needs a multiple of {AMX_BLOCK} output rows, got {n}")
    order = to_tile_order if tiles else to_chunk_order
    supers = k // 256
    data = np.asarray(weight.data).reshape(n, supers, 144)
    qs = torch.empty(n, k // 2, dtype=torch.uint8)
    for r0 in range(0, n, _Q4_K_ROWS_PER_PASS):  # whole blocks of 16 rows a pass (tile order)
        part = np.ascontiguousarray(data[r0:r0 + _Q4_K_ROWS_PER_PASS]).reshape(-1, 144)
        q = torch.from_numpy(q4_k_q(part)).reshape(-1, k)  # [rows, K] in 0..15
        qs[r0:r0 + q.shape[0]] = order(_group_bytes(q))
    sc, mn = k4_scales_mins(np.ascontiguousarray(data[..., 4:16]).reshape(-1, 12))
    scales = torch.from_numpy(np.stack([sc.reshape(n, -1), mn.reshape(n, -1)]))  # [2, N, G]
    dm = torch.from_numpy(np.ascontiguousarray(data[..., 0:4]).view(np.float16).reshape(n, supers, 2).copy())
    if tiles:  # [N / 16, G, 16] each; dm [N / 16, supers, 2, 16] (int4_amx.cpp Q4KTileScales)
        scales = torch.stack([to_tile_rows(scales[0]), to_tile_rows(scales[1])])
        dm = to_tile_rows(dm.reshape(n, supers * 2)).reshape(n, supers, 2)
    return PackedLinear("int4", k, n, qs, bias, scales=scales.contiguous(), zeros=dm, layout=layout,
                        group_size=GROUP_SIZE)


def pack_q4_1(blocks: np.ndarray, in_features: int, bias: torch.Tensor | None,
              layout: str = "q4_1") -> PackedLinear:
    """Q4_1 blocks [N, G * 20] -> the "q4_1" (or "q4_1a8": the same arrays) layout's three arrays."""
    n = blocks.shape[0]
    b = torch.from_numpy(np.ascontiguousarray(blocks)).reshape(n, -1, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    qs = to_chunk_order(b[..., 4:])
    return PackedLinear("int4", in_features, n, qs, bias, scales=d.contiguous(), zeros=m.contiguous(),
                        layout=layout, group_size=GROUP_SIZE)


def pack_q4_1x(blocks: np.ndarray, in_features: int, bias: torch.Tensor | None) -> PackedLinear:
    """Q4_1 blocks [N, G * 20] (N % 16 == 0) -> the "q4_1x" layout: the same values as
    pack_q4_1's, in AMX tile order (to_tile_order)."""
    n = blocks.shape[0]
    if n % AMX_BLOCK:
        raise ValueError(f"the {AMX_LAYOUT} layout needs a multiple of {AMX_BLOCK} output rows, got {n}")
    b = torch.from_numpy(np.ascontiguousarray(blocks)).reshape(n, -1, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    return PackedLinear("int4", in_features, n, to_tile_order(b[..., 4:]), bias, scales=to_tile_rows(d),
                        zeros=to_tile_rows(m), layout=AMX_LAYOUT, group_size=GROUP_SIZE)


def to_tile_rows(v: torch.Tensor) -> torch.Tensor:
    """[N, G] per row and group -> the same shape holding [N / 16, G, 16]: per block of 16 rows
    and group, the 16 rows' values side by side (what one epilogue load takes)."""
    n, g = v.shape
    return v.reshape(n // AMX_BLOCK, AMX_BLOCK, g).transpose(1, 2).reshape(n, g).contiguous()


def from_tile_rows(v: torch.Tensor) -> torch.Tensor:
    n, g = v.shape
    return v.reshape(n // AMX_BLOCK, g, AMX_BLOCK).transpose(1, 2).reshape(n, g)


def to_tile_order(nibbles: torch.Tensor) -> torch.Tensor:
    """ggml's group bytes uint8 [N, G, 16] -> the "q4_1x" weight [N, G * 16] holding, per block
    b of 16 rows and group g, 256 bytes: run c (0..3) of 64, byte j = q[16 b + j / 4][8 c + j % 4]
    | q[16 b + j / 4][8 c + 4 + j % 4] << 4 (int4_amx.cpp: the run's low nibbles are B tile
    row 2 c, its high ones row 2 c + 1)."""
    n, groups, _ = nibbles.shape
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, G, 32], q[k] for k = 0..31
    q = q.reshape(n // AMX_BLOCK, AMX_BLOCK, groups, 4, 2, 4)  # [b, row, g, c, half, i]: k = 8c + 4half + i
    packed = q[..., 0, :] | (q[..., 1, :] << 4)  # [b, row, g, c, i]
    return packed.permute(0, 2, 3, 1, 4).reshape(n, groups * 16).contiguous()  # [b, g, c, row, i]


def from_tile_order(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of to_tile_order: [N, G * 16] -> ggml's group bytes [N, G, 16]."""
    n, groups = weight.shape[0], weight.shape[1] // 16
    packed = weight.reshape(n // AMX_BLOCK, groups, 4, AMX_BLOCK, 4).permute(0, 3, 1, 2, 4)  # [b, row, g, c, i]
    q = torch.stack([packed & 0x0F, packed >> 4], dim=-2)  # [b, row, g, c, half, i]
    q = q.reshape(n, groups, 32)
    return q[..., :16] | (q[..., 16:] << 4)


def _chunk_transposes(groups: int) -> list[tuple[int, int]]:
    """(first group, groups) of each chunk of a row: 16 groups each, the last one fewer."""
    return [(g, min(CHUNK_GROUPS, groups - g)) for g in range(0, groups, CHUNK_GROUPS)]


def to_chunk_order(nibbles: torch.Tensor) -> torch.Tensor:
    """ggml's group bytes uint8 [N, G, 16] -> the "q4_1" layout's weight [N, G * 16]: per chunk
    of C <= 16 groups, byte 2 t + b of group g moves to 2 C t + 2 g + b (int4_linear.cpp)."""
    n, groups, _ = nibbles.shape
    parts = [nibbles[:, g0:g0 + c].reshape(n, c, 8, 2).transpose(1, 2).reshape(n, -1)
             for g0, c in _chunk_transposes(groups)]
    return torch.cat(parts, dim=1).contiguous() if parts else nibbles.reshape(n, 0).contiguous()


def from_chunk_order(weight: torch.Tensor) -> torch.Tensor:
    """The inverse of to_chunk_order: [N, G * 16] -> ggml's group bytes [N, G, 16]."""
    n, groups = weight.shape[0], weight.shape[1] // 16
    parts = [weight[:, 16 * g0:16 * (g0 + c)].reshape(n, 8, c, 2).transpose(1, 2).reshape(n, c, 16)
             for g0, c in _chunk_transposes(groups)]
    return torch.cat(parts, dim=1) if parts else weight.reshape(n, 0, 16)


def _q4_1_parts(packed: PackedLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q float [N, G, 32], d [N, G], m [N, G]) of a "q4_1" or "q4_k" layer: w = q d + m, d
    and m the fp32 values the kernel forms (for "q4_k": d sc and -(dmin mn), exact)."""
    qs = from_tile_order(packed.weight) if packed.layout in AMX_LAYOUTS else from_chunk_order(packed.weight)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    if packed.layout == AMX_LAYOUT:
        return q, from_tile_rows(packed.scales).float(), from_tile_rows(packed.zeros).float()
    if packed.layout in Q4_K_LAYOUTS + (Q4_K_AMX_LAYOUT,):
        dm, sc, mn = packed.zeros, packed.scales[0], packed.scales[1]
        if packed.layout == Q4_K_AMX_LAYOUT:
            n, supers = dm.shape[0], dm.shape[1]
            dm = from_tile_rows(dm.reshape(n, supers * 2)).reshape(n, supers, 2)
            sc, mn = from_tile_rows(sc), from_tile_rows(mn)
        dm = dm.float()  # [N, G / 8, 2]
        sc, mn = (t.float().reshape(packed.out_features, -1, 8) for t in (sc, mn))
        return q, (dm[..., 0:1] * sc).flatten(1), -(dm[..., 1:2] * mn).flatten(1)
    return q, packed.scales.float(), packed.zeros.float()


def _q4_1_dequantize(packed: PackedLinear) -> torch.Tensor:
    q, d, m = _q4_1_parts(packed)
    return (q * d[..., None] + m[..., None]).reshape(q.shape[0], -1)


def pack_groups(groups: Int4Groups, in_features: int, bias: torch.Tensor | None,
                device: torch.device, layout: str | None = None) -> PackedLinear:
    """layout: "cpu" or "nibbles"; default by device (module docstring)."""
    layout = layout or default_layout(device)
    if layout not in ("cpu", "nibbles"):
        raise ValueError(f"unknown int4 layout {layout!r}")
    q, scales, zeros = groups
    n, kp = q.shape
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(torch.bfloat16)  # [G, N, 2]
    if layout == "cpu":
        np_ = _round_up(n, N_ALIGN_CPU)
        q = F.pad(q, (0, 0, 0, np_ - n), value=8)  # (8 - 8) * 0 + 0 = 0
        sz = F.pad(sz, (0, 0, 0, np_ - n))
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    else:
        weight = q[:, 0::2] | (q[:, 1::2] << 4)
    return PackedLinear("int4", in_features, n, weight.to(device).contiguous(), bias,
                        scales=sz.to(device).contiguous(), layout=layout, group_size=GROUP_SIZE)


def unpack_q(packed: PackedLinear) -> torch.Tensor:
    """uint8 [N_stored, Kp] nibble values 0..15 of a packed layer (for dequantize and tests)."""
    if packed.layout == "nibbles":
        w = packed.weight
        return torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1)
    # The aten CPU layout is internal, so ask the kernel itself: identity activations with
    # scale 1 and zero 8 return q^T exactly (integers 0..15 are exact in bf16).
    g, np_ = packed.scales.shape[0], packed.scales.shape[1]
    kp = g * packed.group_size
    unit = torch.stack([torch.ones(g, np_), torch.full((g, np_), 8.0)], dim=-1).to(torch.bfloat16)
    eye = torch.eye(kp, dtype=torch.bfloat16)
    qt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed.weight, packed.group_size, unit)
    return qt.t().round().to(torch.uint8)


def dequantize(packed: PackedLinear) -> torch.Tensor:
    if packed.layout in NATIVE_LAYOUTS:
        return _q4_1_dequantize(packed)[:packed.out_features, :packed.in_features]
    q = unpack_q(packed).float()
    sz = packed.scales.float().transpose(0, 1)  # [N, G, 2]
    idx = torch.arange(q.shape[1], device=q.device) // packed.group_size
    w = (q - 8.0) * sz[:, idx, 0] + sz[:, idx, 1]
    return w[:packed.out_features, :packed.in_features]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [M, K] (K % 32 == 0) -> (xq int16-valued fp32 [M, K], dx [M], sums [M, K/32]):
    per row, dx = max|x| / 32767 and xq = round(x / dx); per group of 32, the exact sum."""
    m, k = x.shape
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # A tensor numerator: `32767.0 / amax` is torch's reciprocal-then-multiply, rounded twice,
    # where the kernel divides once (one element in ~2,000 then rounds to the other integer).
    inv = torch.where(amax > 0, amax.new_tensor(32767.0) / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv[:, None])
    return xq, amax / 32767.0, x.reshape(m, k // GROUP_SIZE, GROUP_SIZE).sum(dim=-1)


def quantize_activations_i8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [M, K] (K % 32 == 0) -> (xq int8-valued fp32 [M, K], dx [M, K/32], sums [M, K/32]):
    per group of 32, dx = max|x| / 127, xq = round(x * (127 / max|x|)) (the kernel's float
    steps), and the exact sum."""
    m, k = x.shape
    xg = x.float().reshape(m, k // GROUP_SIZE, GROUP_SIZE)
    amax = xg.abs().amax(dim=-1)
    inv = torch.where(amax > 0, amax.new_tensor(127.0) / amax, torch.zeros_like(amax))  # as above
    xq = torch.round(xg * inv[..., None]).reshape(m, k)
    return xq, amax / 127.0, xg.sum(dim=-1)


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    if packed.layout not in NATIVE_LAYOUTS:
        return linear_reference(x, dequantize(packed), packed.bias)
    # The native kernel's definition (kernels/csrc/int4_linear.cpp): x rounded to int16 per row
    # ("q4_1": y = dx sum_g d_g (q_g . xq_g) + m_g S_g) or to int8 per group ("q4_1a8":
    # y = sum_g d_g dx_g (q_g . xq_g) + m_g S_g), the m term on the exact group sums.
    kp = packed.weight.shape[1] * 2
    q, d, m = _q4_1_parts(packed)
    xp = F.pad(x.float(), (0, kp - x.shape[1]))
    a8 = packed.layout in A8_LAYOUTS
    xq, dx, sums = quantize_activations_i8(xp) if a8 else quantize_activations(xp)
    xg = xq.reshape(x.shape[0], -1, GROUP_SIZE)  # [M, G, 32]
    dots = torch.einsum("mgi,ngi->mng", xg.double(), q.double())  # exact integers
    if a8:
        y = (dots * d[None].double() * dx.double()[:, None]).sum(-1) + (sums.double() @ m.double().t())
    else:
        y = (dots * d[None].double()).sum(-1) * dx.double()[:, None] + (sums.double() @ m.double().t())
    y = y[:, :packed.out_features].float()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def forward(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x: [M, K] -> [M, N] in x's dtype."""
    if packed.layout in NATIVE_LAYOUTS:
        if (x.shape[0] >= NATIVE_DENSE_MIN_ROWS and packed.layout not in AMX_LAYOUTS
                and not batch_invariance.enabled()):
            # Prefill-sized passes: dequantize, fp32 GEMM; exact weights, unrounded activations.
            return linear_reference(x, dequantize(packed), packed.bias)
        return int4_linear_native(x, packed)
    if packed.layout == "cpu":
        return int4_linear_cpu(x, packed)
    if use_triton(x):
        y = int4_linear_triton(x.to(activation_dtype(x)), packed.weight, packed.scales, packed.group_size, packed.bias)
        return y.to(x.dtype)
    y = F.linear(x.to(torch.bfloat16), dequantize(packed).to(torch.bfloat16)).float()
    return (y if packed.bias is None else y + packed.bias).to(x.dtype)


def int4_linear_native(x: torch.Tensor, packed: PackedLinear, level: str | None = None) -> torch.Tensor:
    """x: [M, K] float -> [M, N]; fp32 activations into kernels/csrc/int4_linear.cpp, rounded
    there to int16 per row ("q4_1") or to int8 per group of 32 ("q4_1a8").
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    kp = packed.weight.shape[1] * 2
    xf = native.fp32_rows(x, kp)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    lib = native.library(level)
    if packed.layout in Q4_K_LAYOUTS:
        native.check(lib.tandem_q4k_linear(
            xf.data_ptr(), m, kp, kp, packed.weight.data_ptr(), packed.scales[0].data_ptr(),
            packed.scales[1].data_ptr(), packed.zeros.data_ptr(), n, native.ptr(packed.bias),
            y.data_ptr(), n, int(packed.layout in A8_LAYOUTS)), "q4_k linear")
    elif packed.layout == Q4_K_AMX_LAYOUT:
        native.check(lib.tandem_q4k_amx_linear(
            xf.data_ptr(), m, kp, kp, packed.weight.data_ptr(), packed.scales[0].data_ptr(),
            packed.scales[1].data_ptr(), packed.zeros.data_ptr(), n, native.ptr(packed.bias),
            y.data_ptr(), n), "q4_k AMX linear")
    elif packed.layout == AMX_LAYOUT:
        native.check(lib.tandem_int4_amx_linear(
            xf.data_ptr(), m, kp, kp, packed.weight.data_ptr(), packed.scales.data_ptr(),
            packed.zeros.data_ptr(), n, native.ptr(packed.bias), y.data_ptr(), n), "int4 AMX linear")
    else:
        kernel = lib.tandem_int4a8_linear if packed.layout == "q4_1a8" else lib.tandem_int4_linear
        native.check(kernel(
            xf.data_ptr(), m, kp, kp, packed.weight.data_ptr(), packed.scales.data_ptr(),
            packed.zeros.data_ptr(), n, native.ptr(packed.bias), y.data_ptr(), n), "int4 linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int4_linear_cpu(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    xb = x.to(torch.bfloat16)
    kp = packed.scales.shape[0] * packed.group_size
    if xb.shape[1] != kp:
        xb = F.pad(xb, (0, kp - xb.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), packed.weight, packed.group_size, packed.scales)
    if y.shape[1] != packed.out_features:
        y = y[:, :packed.out_features]
    if packed.bias is not None:
        y = y.float() + packed.bias
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _int4_weight_only_kernel(
        x_ptr,  # [M, K] activations (fp32/fp16/bf16), unit column stride
        w_ptr,  # [N, KP/2] uint8, byte j = q[2j] | q[2j+1] << 4, unit column stride
        sz_ptr,  # [KP/GROUP, N, 2] contiguous (scale, zero): w = (q - 8) * scale + zero
        b_ptr,  # [N] fp32 bias (read only if HAS_BIAS)
        y_ptr,  # [M, N] output, unit column stride
        M, N, K, KP,
        stride_xm, stride_wn, stride_ym,
        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Even and odd k are handled as two half-tiles (low and high nibbles), so no interleave
        # is needed: acc += x[:, even] @ w_lo + x[:, odd] @ w_hi. GROUP is even, so a byte's two
        # nibbles share one (scale, zero).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = tl.arange(0, BLOCK_K // 2)
        m_mask = offs_m < M
        n_mask = offs_n < N
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
        x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm  # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, KP, BLOCK_K):
            j = k0 // 2 + offs_j  # byte column
            k_even = 2 * j
            wmask = (k_even < KP)[:, None] & n_mask[None, :]
            packed = tl.load(w_cols + j[:, None], mask=wmask, other=0)  # [BK/2, BN]
            sz = sz_ptr + ((k_even // GROUP).to(tl.int64)[:, None] * N + offs_n[None, :]) * 2
            scale = tl.load(sz, mask=wmask, other=0.0).to(tl.float32)
            zero = tl.load(sz + 1, mask=wmask, other=0.0).to(tl.float32)
            w_lo = ((packed & 0xF).to(tl.float32) - 8.0) * scale + zero
            w_hi = ((packed >> 4).to(tl.float32) - 8.0) * scale + zero
            if BLOCK_M == 1:
                # GEMV (decode): x as [BK/2, 1] columns, multiply and reduce over K.
                xe = tl.load(x_rows[None, :] + k_even[:, None],
                             mask=(k_even < K)[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
                xo = tl.load(x_rows[None, :] + k_even[:, None] + 1,
                             mask=(k_even + 1 < K)[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(xe * w_lo + xo * w_hi, axis=0)[None, :]
            else:
                xe = tl.load(x_rows[:, None] + k_even[None, :],
                             mask=m_mask[:, None] & (k_even < K)[None, :], other=0.0)  # [BM, BK/2]
                xo = tl.load(x_rows[:, None] + k_even[None, :] + 1,
                             mask=m_mask[:, None] & (k_even + 1 < K)[None, :], other=0.0)
                acc += tl.dot(xe, w_lo.to(xe.dtype))
                acc += tl.dot(xo, w_hi.to(xo.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_linear_triton(x: torch.Tensor, w: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] float; w: uint8 [N, Kp/2] ("nibbles" layout); scales_and_zeros: [Kp/group, N, 2];
    bias: fp32 [N] -> [M, N] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("int4_linear_triton needs triton")
    m, k = x.shape
    n, kp = w.shape[0], 2 * w.shape[1]
    assert x.stride(1) == 1 and w.dtype == torch.uint8 and w.stride(1) == 1 and kp >= k
    assert group_size % 2 == 0 and kp % group_size == 0
    assert scales_and_zeros.shape == (kp // group_size, n, 2) and scales_and_zeros.is_contiguous()
    assert bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = gemm_tiles(m, x)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    record_launch("int4_gemm")
    _int4_weight_only_kernel[grid](
        x, w, scales_and_zeros, bias if bias is not None else scales_and_zeros, y,
        m, n, k, kp, x.stride(0), w.stride(0), y.stride(0),
        GROUP=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
