"""K-quant blocks for test fixtures: `gguf.quants` dequantizes Q4_K/Q5_K/Q6_K but cannot
quantize them, and no llama.cpp quantizer is built here.

    quantize_k(w [rows, cols] fp32, "Q4_K" | "Q5_K" | "Q6_K") -> uint8 [rows, cols / 256 * bytes]
    random_blocks(ggml_type, rows, blocks_per_row, rng) -> uint8 [rows, blocks_per_row * bytes]

quantize_k is a plain round-to-nearest fit (llama.cpp searches scales more carefully), written
for the block layouts in kernels/ggml_dequant.py; its blocks are valid, and close enough to
`w` that a quantized tiny model still behaves like the float one. random_blocks fills every
quantized field with random bytes and every fp16 field with a finite value, so a dequantizer
meets every bit pattern of the scales and quants.
"""

from __future__ import annotations

import numpy as np

from kernels.ggml_dequant import BLOCKS, QK_K

# Byte offsets of each type's fp16 fields (d, dmin / m) within a block.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(ggml_type: str, rows: int, blocks_per_row: int,
                  rng: np.random.Generator) -> np.ndarray:
    n, block_bytes = rows * blocks_per_row, BLOCKS[ggml_type][1]
    blocks = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset:offset + 2] = (rng.standard_normal((n, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit sc, mn [n, 8] -> scales[12] [n, 12] (kernels/ggml_dequant.py's layout)."""
    lo = sc[:, :4] | (sc[:, 4:] >> 4 << 6)
    hi = mn[:, :4] | (mn[:, 4:] >> 4 << 6)
    mixed = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([lo, hi, mixed], axis=-1).astype(np.uint8)


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K fit of x [n, 8, 32]: (d, dmin [n], sc, mn uint8 [n, 8], q uint8 [n, 8, 32])."""
    lo = np.minimum(x.min(-1), 0.0)
    scale, minus = (x.max(-1) - lo) / levels, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (minus.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63)
    mn = np.clip(np.rint(_safe_div(minus, dmin[:, None])), 0, 63)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_safe_div(x + offset, np.broadcast_to(step, x.shape).copy())), 0, levels)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (low 4 bits used) -> qs [n, 128]: chunk c = sub-block 2c | 2c+1 << 4."""
    q = q.reshape(len(q), 4, 2, 32) & 15
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn),
                           _nibble_bytes(q)], axis=-1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # [n, 32]
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales_mins(sc, mn), qh,
                           _nibble_bytes(q)], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = len(x)
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), -128, 127)
    step = np.broadcast_to((d[:, None] * sc)[..., None], sub.shape).copy()
    q = (np.clip(np.rint(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # Half h, quarter j: weights 32j..32j+31 of that half (kernels/ggml_dequant.py's layout).
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1)  # [n, 2, 64]
    qh = sum(((q[:, :, j] >> 4) & 3) << (2 * j) for j in range(4)).astype(np.uint8)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)


_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(w: np.ndarray, ggml_type: str) -> np.ndarray:
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"{ggml_type} needs rows of a multiple of {QK_K} weights, got {cols}")
    blocks = _QUANTIZERS[ggml_type](np.asarray(w, np.float32).reshape(-1, QK_K))
    return np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows, -1)
