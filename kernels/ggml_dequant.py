"""GGML block-quantized rows -> fp32, in numpy, from llama.cpp's block layouts (ggml-common.h).

    dequantize_rows(ggml_type, data [rows, bytes_per_row] uint8) -> fp32 [rows, cols]
    q4_k_groups(data) -> (q, scale, minus)   Q4_K as 4-bit groups of 32: w = scale * q - minus,
                                             for a repack into int4 without rounding q
    BLOCKS[ggml_type] = (weights per block, bytes per block)

Every block is independent and blocks run along a row, so a row is a run of whole blocks.
"d", "dmin", "m" are fp16; all arithmetic is fp32 in the order llama.cpp's reference
(dequantize_row_*) uses, one rounding per operation, so results are bit-equal to
`gguf.quants.dequantize` (the test oracle, never called here).

Legacy blocks, 32 weights; element i < 16 is the low nibble of qs[i], element 16 + i the high:

    Q4_0  18 B  d | qs[16]                    w = d * (q - 8)
    Q4_1  20 B  d | m | qs[16]                w = d * q + m
    Q5_0  22 B  d | qh u32 | qs[16]           q = nibble | (bit i of qh) << 4;  w = d * (q - 16)
    Q5_1  24 B  d | m | qh u32 | qs[16]       w = d * q + m
    Q8_0  34 B  d | qs int8[32]               w = q * d

K-quants, super-blocks of 256 weights:

    Q4_K  144 B  d | dmin | scales[12] | qs[128]
    Q5_K  176 B  d | dmin | scales[12] | qh[32] | qs[128]
          8 sub-blocks of 32, each with a 6-bit scale sc and 6-bit min mn packed in scales[12]:
              j < 4:  sc = s[j] & 63                    mn = s[j+4] & 63
              j >= 4: sc = s[j+4] & 15 | s[j-4] >> 6 << 4
                      mn = s[j+4] >> 4 | s[j]   >> 6 << 4
          w = (d * sc) * q - (dmin * mn)
          qs: 32-byte chunk c holds sub-block 2c in its low nibbles, 2c+1 in its high ones.
          Q5_K: bit j of qh[l] is the fifth bit of weight l of sub-block j.
    Q6_K  210 B  ql[128] | qh[64] | scales int8[16] | d
          two halves of 128 weights (ql[64], qh[32] each); weight l of a half, l < 32:
              q[l]      = ql[l]      & 15 | (qh[l] >> 0 & 3) << 4
              q[l + 32] = ql[l + 32] & 15 | (qh[l] >> 2 & 3) << 4
              q[l + 64] = ql[l]      >> 4 | (qh[l] >> 4 & 3) << 4
              q[l + 96] = ql[l + 32] >> 4 | (qh[l] >> 6 & 3) << 4
          w = (d * scales[i // 16]) * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256

BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] fp32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2k]: the k low nibbles, then the k high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qh [n, 4] bytes (a little-endian u32) -> [n, 32] bits shifted to 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits << 4


def _q4_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(b[:, 0:2]) * q.astype(np.float32)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = (_nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])).astype(np.int8) - np.int8(16)
    return _f16(b[:, 0:2]) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    return _f16(b[:, 0:2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32) * _f16(b[:, 0:2])


def k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K scales[12] [n, 12] -> (sc, mn), each uint8 [n, 8] in 0..63 (module docstring)."""
    lo, hi, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mixed & 15) | (lo >> 6 << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (mixed >> 4) | (hi >> 6 << 4)], axis=-1)
    return sc, mn


def _k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k4_scales_mins as fp32 [n, 8, 1] each."""
    sc, mn = k4_scales_mins(s)
    return sc.astype(np.float32)[..., None], mn.astype(np.float32)[..., None]


def _k_quant(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: q [n, 8, 32] fp32 -> w [n, 256]."""
    sc, mn = _k4_scales_mins(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2])[..., None], _f16(b[:, 2:4])[..., None]
    # In place on q (a fresh fp32 array): the same two roundings as (d * sc) * q - dmin * mn.
    np.multiply(q, d * sc, out=q)
    np.subtract(q, dmin * mn, out=q)
    return q.reshape(len(b), QK_K)


def q4_k_q(b: np.ndarray) -> np.ndarray:
    """Q4_K blocks [n, 144] -> q uint8 [n, 8, 32] (0..15) per group of 32."""
    return _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_quant(b, q4_k_q(b).astype(np.float32))


def q4_k_groups(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows [rows, bytes] -> (q uint8 [rows, cols], scale fp32 [rows, cols / 32],
    minus fp32 [rows, cols / 32]) with w = scale * q - minus per group of 32, the very products
    dequantize_rows forms (scale = d * sc, minus = dmin * mn)."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(-1, BLOCKS["Q4_K"][1])
    sc, mn = _k4_scales_mins(b[:, 4:16])
    scale = (_f16(b[:, 0:2]) * sc[..., 0]).reshape(rows, -1)
    minus = (_f16(b[:, 2:4]) * mn[..., 0]).reshape(rows, -1)
    return q4_k_q(b).reshape(rows, -1), scale, minus


def _q5_k(b: np.ndarray) -> np.ndarray:
    qh = b[:, 16:48]  # [n, 32]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = (_nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32) | (high << 4))
    return _k_quant(b, q.astype(np.float32))


def q6_k_q(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, 210] -> q uint8 [n, 256] in 0..63 (w = d * scales[i // 16] * (q - 32))."""
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    low = _nibbles(ql)  # [n, 2, 128]: ql[0:64] & 15 at 0..63, ql[0:64] >> 4 at 64..127
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    return (low | (high.reshape(n, 2, 128) << 4)).reshape(n, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    q = q6_k_q(b).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    ds = (_f16(b[:, 208:210]) * scales)[..., None]  # [n, 16, 1]
    w = q.reshape(n, 16, 16).astype(np.float32)
    np.multiply(ds, w, out=w)
    return w.reshape(n, QK_K)


_BLOCK_DEQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def dequantize_rows(ggml_type: str, data: np.ndarray) -> np.ndarray:
    """data: uint8 [rows, bytes_per_row], whole blocks of `ggml_type` -> fp32 [rows, cols]."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"no dequantizer for ggml type {ggml_type} (have: {', '.join(BLOCKS)})")
    block, block_bytes = BLOCKS[ggml_type]
    rows, row_bytes = data.shape
    if row_bytes % block_bytes:
        raise ValueError(f"{ggml_type} rows of {row_bytes} bytes are not whole {block_bytes}-byte blocks")
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    return _BLOCK_DEQUANTIZERS[ggml_type](blocks).reshape(rows, row_bytes // block_bytes * block)
