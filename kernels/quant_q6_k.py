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
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import native
from kernels.ggml_dequant import BLOCKS, q6_k_q
from kernels.linear import PackedLinear
from kernels.quant_int4 import quantize_activations
from kernels.quantized_tensor import QuantizedTensor

LAYOUT = "q6_k"
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


def pack(weight: QuantizedTensor, bias: torch.Tensor | None) -> PackedLinear:
    """A Q6_K GGUF matrix [N, K] -> the "q6_k" layout (module docstring). Rows are reordered a
    pass at a time; only the packed arrays outlive the call."""
    if not isinstance(weight, QuantizedTensor) or weight.ggml_type != "Q6_K":
        raise ValueError(f"the q6_k layout takes Q6_K GGUF blocks, got "
                         f"{getattr(weight, 'ggml_type', type(weight).__name__)}")
    n, k = weight.shape
    blocks_per_row = k // SB
    data = np.asarray(weight.data).reshape(n, blocks_per_row, _BLOCK_BYTES)
    qb = np.empty((n, blocks_per_row * SB_BYTES), np.uint8)
    for r0 in range(0, n, _ROWS_PER_PASS):
        part = np.ascontiguousarray(data[r0:r0 + _ROWS_PER_PASS]).reshape(-1, _BLOCK_BYTES)
        qb[r0:r0 + _ROWS_PER_PASS] = _kernel_order(q6_k_q(part)).reshape(-1, blocks_per_row * SB_BYTES)
    sc = np.ascontiguousarray(data[..., 192:208]).view(np.int8).reshape(n, blocks_per_row * 16)
    d = np.ascontiguousarray(data[..., 208:210]).view(np.float16).reshape(n, blocks_per_row)
    return PackedLinear("int8", k, n, torch.from_numpy(qb), bias, scales=torch.from_numpy(sc.copy()),
                        zeros=torch.from_numpy(d.copy()), layout=LAYOUT)


def q_values(packed: PackedLinear) -> torch.Tensor:
    """int q - 32 as fp32 [N, K] (the file's values, -32..31)."""
    n = packed.out_features
    q = _from_kernel_order(packed.weight.numpy().reshape(-1, SB_BYTES))
    return torch.from_numpy(q.astype(np.float32) - np.float32(32.0)).reshape(n, -1)


def _sub_block_scales(packed: PackedLinear) -> torch.Tensor:
    """d * sc per sub-block, fp32 [N, K / 16] (exact: 11 by 8 significant bits)."""
    n = packed.out_features
    d = packed.zeros.float().reshape(n, -1, 1)
    return (d * packed.scales.float().reshape(n, -1, 16)).reshape(n, -1)


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
    """x: [M, K] float -> [M, N] through kernels/csrc/q6k_linear.cpp.
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    k = packed.in_features
    xf = native.fp32_rows(x, k)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    native.check(native.library(level).tandem_q6k_linear(
        xf.data_ptr(), m, k, k, packed.weight.data_ptr(), packed.scales.data_ptr(),
        packed.zeros.data_ptr(), n, native.ptr(packed.bias), y.data_ptr(), n), "q6_k linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)

