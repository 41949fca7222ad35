"""GGUF Q6_K matrices as the int8 format's "q6_k" layout: the file's 6-bit blocks, read by the
native CPU kernel as they are (kernels/csrc/q6k_linear.cpp), with no requantization.

llama.cpp's Q4_K_M keeps the lm_head (or the tied embedding table) and half of ffn_down and
attn_v in Q6_K. Under the int4 decode format those matrices take the int8 format
(engine/format_choice.py); its per-row "native" layout would requantize them (8 bits and a
scale a row: 8 bits a weight read every step, against Q6_K's 6.5625, and a second rounding).
This layout keeps the file's bytes, reordered at load so that the kernel's unpack is a few
vector instructions (the order is documented in the C++ source), beside the file's sub-block
scales and super-block d:

    weight  uint8 [N, K / 256 * 192]   the q of each super-block, in the kernel's run order
    scales  int8  [N, K / 16]          sc per sub-block of 16
    zeros   fp16  [N, K / 256]         d per super-block (the field's name is PackedLinear's)
    w[16 g + e] = (d * sc[g]) * (q - 32),   q in 0..63

`dequantize` equals kernels/ggml_dequant.py's Q6_K dequantizer (and gguf.quants) bit for bit;
`reference` is the kernel's arithmetic (x rounded to int16 per row, as the int8 format's
"native" layout does) in torch.

"q6_kx" (AMX_LAYOUT): the same q, sc and d in AMX tile order, for kernels/csrc/int4_amx.cpp's
tile kernel where the CPU and OS grant AMX tiles (kernels/native.py `amx_available`) and the
rows come in blocks of 16:

    weight  uint8 [N, K / 256 * 192]   per block b of 16 rows and sub-block s, 192 bytes at
                                       (b K / 16 + s) 192 (to_tile_order)
    scales  int8  [N, K / 16]          holding [N / 16, K / 16, 16]: the 16 rows' sc side by side
    zeros   fp16  [N, K / 256]         holding [N / 16, K / 256, 16]: the 16 rows' d

The integer dots are those of the "q6_k" kernel, so `reference` is the same; only the order of
the float sums differs (per weight row over sub-blocks, against per sub-block lane).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import native
from kernels.ggml_dequant import BLOCKS, q6_k_q
from kernels.linear import PackedLinear
from kernels.quant_int4 import AMX_BLOCK, from_tile_rows, quantize_activations, to_tile_rows
from kernels.quantized_tensor import QuantizedTensor

LAYOUT = "q6_k"
AMX_LAYOUT = "q6_kx"
LAYOUTS = (LAYOUT, AMX_LAYOUT)
SB = 256  # weights per super-block
SB_BYTES = 192  # the kernel's bytes of q per super-block
_BLOCK_BYTES = BLOCKS["Q6_K"][1]
_ROWS_PER_PASS = 1024  # rows reordered at a time, so a large matrix's temporaries stay small


def _kernel_order(q: np.ndarray) -> np.ndarray:
    """q uint8 [R, 256] (0..63, one super-block a row) -> [R, 192] in the kernel's run order:
    vector v's lane 2 g + b is element 2 v + b of sub-block g; run t's bytes hold vectors 2 t
    (low nibble) and 2 t + 1 (high nibble) low 4 bits, run s's bytes the high 2 bits of vectors
    4 s .. 4 s + 3 (bits 2 k, 2 k + 1 for vector 4 s + k)."""
    r = q.shape[0]
    vec = q.reshape(r, 16, 8, 2).transpose(0, 2, 1, 3).reshape(r, 8, 32)  # [R, v, lane]
    low = vec & 0x0F
    runs = low[:, 0::2] | (low[:, 1::2] << 4)  # [R, 4, 32]
    high = (vec >> 4).reshape(r, 2, 4, 32)  # [R, s, k, lane]
    pairs = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([runs.reshape(r, 128), pairs.reshape(r, 64)], axis=1)


def _from_kernel_order(qb: np.ndarray) -> np.ndarray:
    """The inverse: [R, 192] -> q uint8 [R, 256]."""
    r = qb.shape[0]
    runs, pairs = qb[:, :128].reshape(r, 4, 32), qb[:, 128:].reshape(r, 2, 32)
    low = np.stack([runs & 0x0F, runs >> 4], axis=2).reshape(r, 8, 32)
    high = np.stack([(pairs >> (2 * k)) & 3 for k in range(4)], axis=2).reshape(r, 8, 32)
    vec = low | (high << 4)
    return vec.reshape(r, 8, 16, 2).transpose(0, 2, 1, 3).reshape(r, SB)


def to_tile_order(q: np.ndarray) -> np.ndarray:
    """q uint8 [R, K] (0..63, R % 16 == 0) -> [R, K * 3 / 4] in the tile kernel's order: per
    block b of 16 rows and sub-block s, B tile row kk's byte j is q[16 b + j / 4][16 s + 4 kk +
    j % 4] (int4_amx.cpp build_q6_tile); its low 4 bits go to byte j of run kk / 2 (0..127),
    low nibble for even kk, high for odd; its high 2 bits to bits 2 kk, 2 kk + 1 of byte 128 + j."""
    r, k = q.shape
    t = q.reshape(r // AMX_BLOCK, AMX_BLOCK, k // 16, 4, 4).transpose(0, 2, 3, 1, 4)
    t = t.reshape(r // AMX_BLOCK, k // 16, 4, 64)  # [b, s, kk, j]
    low, high = t & 0x0F, t >> 4
    runs = low[:, :, 0::2] | (low[:, :, 1::2] << 4)  # [b, s, 2, 64]
    bits = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([runs.reshape(r // AMX_BLOCK, k // 16, 128), bits], axis=2).reshape(r, -1)


def from_tile_order(qb: np.ndarray) -> np.ndarray:
    """The inverse: [R, K * 3 / 4] -> q uint8 [R, K]."""
    r = qb.shape[0]
    k = qb.shape[1] * 4 // 3
    steps = qb.reshape(r // AMX_BLOCK, k // 16, 192)
    runs, bits = steps[..., :128].reshape(r // AMX_BLOCK, k // 16, 2, 64), steps[..., 128:]
    low = np.stack([runs & 0x0F, runs >> 4], axis=3).reshape(r // AMX_BLOCK, k // 16, 4, 64)
    high = np.stack([(bits >> (2 * kk)) & 3 for kk in range(4)], axis=2)
    t = (low | (high << 4)).reshape(r // AMX_BLOCK, k // 16, 4, AMX_BLOCK, 4).transpose(0, 3, 1, 2, 4)
    return np.ascontiguousarray(t).reshape(r, k)


def pack(weight: QuantizedTensor, bias: torch.Tensor | None, layout: str = LAYOUT) -> PackedLinear:
    """A Q6_K GGUF matrix [N, K] -> the "q6_k" or "q6_kx" layout (module docstring). Rows are
    reordered a pass at a time; only the packed arrays outlive the call."""
    if not isinstance(weight, QuantizedTensor) or weight.ggml_type != "Q6_K":
        raise ValueError(f"the {layout} layout takes Q6_K GGUF blocks, got "
                         f"{getattr(weight, 'ggml_type', type(weight).__name__)}")
    n, k = weight.shape
    tiles = layout == AMX_LAYOUT
    if tiles and n % AMX_BLOCK:
        raise ValueError(f"the {layout} layout needs a multiple of {AMX_BLOCK} output rows, got {n}")
    blocks_per_row = k // SB
    data = np.asarray(weight.data).reshape(n, blocks_per_row, _BLOCK_BYTES)
    qb = np.empty((n, blocks_per_row * SB_BYTES), np.uint8)
    for r0 in range(0, n, _ROWS_PER_PASS):  # whole blocks of 16 rows a pass
        part = np.ascontiguousarray(data[r0:r0 + _ROWS_PER_PASS]).reshape(-1, _BLOCK_BYTES)
        q = q6_k_q(part)
        if tiles:
            qb[r0:r0 + _ROWS_PER_PASS] = to_tile_order(q.reshape(-1, k))
        else:
            qb[r0:r0 + _ROWS_PER_PASS] = _kernel_order(q).reshape(-1, blocks_per_row * SB_BYTES)
    sc = torch.from_numpy(np.ascontiguousarray(data[..., 192:208]).view(np.int8).reshape(n, blocks_per_row * 16).copy())
    d = torch.from_numpy(np.ascontiguousarray(data[..., 208:210]).view(np.float16).reshape(n, blocks_per_row).copy())
    if tiles:
        sc, d = to_tile_rows(sc), to_tile_rows(d)
    return PackedLinear("int8", k, n, torch.from_numpy(qb), bias, scales=sc, zeros=d, layout=layout)


def q_values(packed: PackedLinear) -> torch.Tensor:
    """int q - 32 as fp32 [N, K] (the file's values, -32..31)."""
    n, k = packed.out_features, packed.in_features
    if packed.layout == AMX_LAYOUT:
        q = from_tile_order(packed.weight.numpy())
    else:
        q = _from_kernel_order(packed.weight.numpy().reshape(-1, SB_BYTES))
    return torch.from_numpy(q.astype(np.float32) - np.float32(32.0)).reshape(n, k)


def _sub_block_scales(packed: PackedLinear) -> torch.Tensor:
    """d * sc per sub-block, fp32 [N, K / 16] (exact: 11 by 8 significant bits)."""
    n = packed.out_features
    sc, d = packed.scales, packed.zeros
    if packed.layout == AMX_LAYOUT:
        sc, d = from_tile_rows(sc), from_tile_rows(d)
    return (d.float().reshape(n, -1, 1) * sc.float().reshape(n, -1, 16)).reshape(n, -1)


def dequantize(packed: PackedLinear) -> torch.Tensor:
    """fp32 [N, K]: (d * sc) * (q - 32), ggml's products and their one rounding."""
    n, k = packed.out_features, packed.in_features
    return (q_values(packed).reshape(n, -1, 16) * _sub_block_scales(packed)[..., None]).reshape(n, k)


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """The kernel's arithmetic: x rounded to int16 per row (xq = round(x / dx), dx = max|x| /
    32767), each sub-block's integer dot scaled by d * sc, times dx."""
    n, k = packed.out_features, packed.in_features
    xq, dx, _ = quantize_activations(x.float())
    dots = torch.einsum("mgi,ngi->mng", xq.double().reshape(x.shape[0], -1, 16),
                        q_values(packed).double().reshape(n, -1, 16))  # exact integers
    y = (dots * _sub_block_scales(packed).double()[None]).sum(-1) * dx.double()[:, None]
    y = y.float()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def q6k_linear_native(x: torch.Tensor, packed: PackedLinear, level: str | None = None) -> torch.Tensor:
    """x: [M, K] float -> [M, N] through kernels/csrc/q6k_linear.cpp ("q6_k") or the AMX tile
    kernel (kernels/csrc/int4_amx.cpp, "q6_kx").
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    k = packed.in_features
    xf = native.fp32_rows(x, k)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    lib = native.library(level)
    kernel = lib.tandem_q6k_amx_linear if packed.layout == AMX_LAYOUT else lib.tandem_q6k_linear
    native.check(kernel(xf.data_ptr(), m, k, k, packed.weight.data_ptr(), packed.scales.data_ptr(),
                        packed.zeros.data_ptr(), n, native.ptr(packed.bias), y.data_ptr(), n),
                 f"{packed.layout} linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)



def default_layout(out_features: int) -> str:
    """The native layout for a Q6_K matrix of this many rows: "q6_kx" where the CPU and OS grant
    AMX tiles, the rows are whole blocks of 16, and either the layers run prompt passes only
    (kernels/layout_choice.py prompt_passes) or the tile kernel measured faster on this host at
    decode sizes (M = 1 and M = 8 weighed alike; weights in cache, or streamed from memory for
    a model that outgrows the last-level cache, as the int4 choice does), once, remembered by
    kernels/layout_choice.py; else "q6_k"."""
    from kernels.layout_choice import fastest_layout, last_level_cache_bytes, runs_prompt_passes, streams_weights

    if out_features % AMX_BLOCK or not native.amx_available():
        return LAYOUT
    if runs_prompt_passes():  # 64 rows of an 8192 x 2048 matrix, one thread: 14 ms, "q6_k" 21
        return AMX_LAYOUT

    if streams_weights(_BLOCK_BYTES / SB):
        copies = min(1024, -(-2 * last_level_cache_bytes() // (_TIMED_N * _TIMED_K * _BLOCK_BYTES // SB)))
        return fastest_layout("q6_k", [LAYOUT, AMX_LAYOUT], lambda lay: _time_layout(lay, copies, reps=1),
                              variant="streamed")
    return fastest_layout("q6_k", [LAYOUT, AMX_LAYOUT], lambda lay: _time_layout(lay, 8, reps=3))


_TIMED_N, _TIMED_K = 1024, 2048  # the timed matrices: a 1B model's attn_v/ffn_down order of size


def _random_blocks(n: int, k: int, rng: np.random.Generator) -> QuantizedTensor:
    """Q6_K blocks of random q and sc (any bytes are a valid block) under a small finite d."""
    data = rng.integers(0, 256, (n * k // SB, _BLOCK_BYTES), dtype=np.uint8)
    data[:, 208:210] = np.array([0.001], np.float16).view(np.uint8)
    return QuantizedTensor("Q6_K", data.reshape(n, -1), (n, k))


def _time_layout(layout: str, copies: int, reps: int) -> tuple[float, float]:
    """Seconds for decode-shaped passes (M = 1, M = 8) over `copies` distinct timed matrices."""
    from kernels.layout_choice import time_decode_passes

    packed = pack(_random_blocks(_TIMED_N, _TIMED_K, np.random.default_rng(0)), None, layout)
    return time_decode_passes(packed, q6k_linear_native, copies, reps)
