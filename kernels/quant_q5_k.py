"""GGUF Q5_K matrices as the int8 format's "q5_k" layout: the file's 5-bit values, sub-block
scales and mins, read by the native CPU kernel with no requantization (kernels/csrc/
q6k_linear.cpp, `tandem_q5k_linear`).

A Q5_K super-block is 256 weights: 8 sub-blocks of 32, each with a 6-bit scale sc and min m,
under an fp16 d and dmin (w = d * sc * q - dmin * m, q in 0..31). Q5_K_M files keep most of
their matrices in it. The int8 format's per-row "native" layout would requantize them (8 bits
and one scale a row, a second rounding); this layout keeps the file's q in the Q6_K layout's
byte order (kernels/quant_q6_k.py: 6 bits stored, the top one zero) beside the file's own
scales, mins and d/dmin:

    weight  uint8 [N, K / 256 * 192]   q, in the Q6_K kernel's run order
    scales  uint8 [2, N, K / 32]       sc, m: 6-bit, one of each per sub-block (as "q4_k")
    zeros   fp16 [N, K / 256 * 2]      (d, dmin) per super-block, as the file stores them

6.625 bits a weight against the file's 5.5 (and 8 requantized to int8 per row). `dequantize`
equals gguf.quants' Q5_K dequantizer bit for bit; `reference` is the kernel's arithmetic (x
rounded to int16 per row) in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import native
from kernels.ggml_dequant import BLOCKS, k4_scales_mins
from kernels.linear import PackedLinear
from kernels.quant_int4 import quantize_activations
from kernels.quant_q6_k import SB, SB_BYTES, _from_kernel_order, _kernel_order
from kernels.quantized_tensor import QuantizedTensor

LAYOUT = "q5_k"
SUB = 32  # weights per sub-block (a scale and a min)
_BLOCK_BYTES = BLOCKS["Q5_K"][1]  # d, dmin | scales[12] | qh[32] | qs[128]
_ROWS_PER_PASS = 1024


def q5_k_q(b: np.ndarray) -> np.ndarray:
    """Q5_K blocks [n, 176] -> q uint8 [n, 256] in 0..31, in weight order."""
    qs, qh = b[:, 48:].reshape(-1, 4, 32), b[:, 16:48]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(-1, 8, 32)  # sub-block j: 32 j + i
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).reshape(-1, SB)


def pack(weight: QuantizedTensor, bias: torch.Tensor | None) -> PackedLinear:
    """A Q5_K GGUF matrix [N, K] -> the "q5_k" layout (module docstring)."""
    if not isinstance(weight, QuantizedTensor) or weight.ggml_type != "Q5_K":
        raise ValueError(f"the q5_k layout takes Q5_K GGUF blocks, got "
                         f"{getattr(weight, 'ggml_type', type(weight).__name__)}")
    n, k = weight.shape
    per_row = k // SB
    data = np.asarray(weight.data).reshape(n, per_row, _BLOCK_BYTES)
    qb = np.empty((n, per_row * SB_BYTES), np.uint8)
    for r0 in range(0, n, _ROWS_PER_PASS):
        part = np.ascontiguousarray(data[r0:r0 + _ROWS_PER_PASS]).reshape(-1, _BLOCK_BYTES)
        qb[r0:r0 + _ROWS_PER_PASS] = _kernel_order(q5_k_q(part)).reshape(-1, per_row * SB_BYTES)
    sc, mn = k4_scales_mins(np.ascontiguousarray(data[..., 4:16]).reshape(-1, 12))
    dd = np.ascontiguousarray(data[..., 0:4]).view(np.float16).reshape(n, per_row * 2)
    scales = torch.from_numpy(np.stack([sc.reshape(n, -1), mn.reshape(n, -1)]))  # [2, N, K / 32]
    return PackedLinear("int8", k, n, torch.from_numpy(qb), bias, scales=scales.contiguous(),
                        zeros=torch.from_numpy(dd.copy()), layout=LAYOUT)


def q_values(packed: PackedLinear) -> torch.Tensor:
    """The file's q (0..31) as fp32 [N, K]."""
    q = _from_kernel_order(packed.weight.numpy().reshape(-1, SB_BYTES))
    return torch.from_numpy(q.astype(np.float32)).reshape(packed.out_features, -1)


def _scale_and_min(packed: PackedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """d * sc and dmin * m per sub-block, fp32 [N, K / 32] each (exact: 11 by 6 bits)."""
    n = packed.out_features
    dd = packed.zeros.float().reshape(n, -1, 1, 2)
    sc, mn = (s.float().reshape(n, -1, 8) for s in packed.scales)
    return (dd[..., 0] * sc).reshape(n, -1), (dd[..., 1] * mn).reshape(n, -1)


def dequantize(packed: PackedLinear) -> torch.Tensor:
    """fp32 [N, K]: (d * sc) * q - dmin * m, ggml's products and roundings."""
    n, k = packed.out_features, packed.in_features
    scale, minus = _scale_and_min(packed)
    q = q_values(packed).reshape(n, -1, SUB)
    return (q * scale[..., None] - minus[..., None]).reshape(n, k)


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """The kernel's arithmetic: x rounded to int16 per row (xq = round(x / dx), dx = max|x| /
    32767), each sub-block's integer dot scaled by d * sc, less dmin * m times its sum of xq,
    times dx."""
    n, k = packed.out_features, packed.in_features
    xq, dx, _ = quantize_activations(x.float())
    xs = xq.double().reshape(x.shape[0], -1, SUB)
    dots = torch.einsum("msi,nsi->mns", xs, q_values(packed).double().reshape(n, -1, SUB))  # exact
    scale, minus = (t.double()[None] for t in _scale_and_min(packed))
    y = (dots * scale - xs.sum(-1)[:, None] * minus).sum(-1) * dx.double()[:, None]
    y = y.float()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def q5k_linear_native(x: torch.Tensor, packed: PackedLinear, level: str | None = None) -> torch.Tensor:
    """x: [M, K] float -> [M, N] through kernels/csrc/q6k_linear.cpp's Q5_K entry.
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    k = packed.in_features
    xf = native.fp32_rows(x, k)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    native.check(native.library(level).tandem_q5k_linear(
        xf.data_ptr(), m, k, k, packed.weight.data_ptr(), packed.scales[0].data_ptr(),
        packed.scales[1].data_ptr(), packed.zeros.data_ptr(), n, native.ptr(packed.bias),
        y.data_ptr(), n), "q5_k linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
