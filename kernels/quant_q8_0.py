"""GGUF Q8_0 matrices as the int8 format's "q8_0" layout: the file's int8 blocks, read by the
native CPU kernel as they are (kernels/csrc/q6k_linear.cpp, `tandem_q8_0_linear`), with no
requantization.

A Q8_0 block is 32 int8 q and one fp16 d (w = d * q). The int8 format's per-row "native"
layout would requantize such a matrix (one scale a row instead of one per 32 weights: a second
rounding, coarser than the file's). This layout keeps the file's q, reordered at load per 256
weights into the order of the Q6_K kernel's tiles (sub-blocks of 16, two to a Q8_0 block), and
its d:

    weight  int8 [N, K]          q, each 256 weights as 8 runs of 32 (run v's byte 2 g + b is
                                 element 2 v + b of sub-block g)
    scales  fp16 [N, K / 32]     d per block
    w[32 b + i] = d[b] * q

It needs K % 256 == 0 (the kernel's tile); other matrices keep the "native" layout.
`dequantize` equals gguf.quants' Q8_0 dequantizer bit for bit; `reference` is the kernel's
arithmetic (x rounded to int16 per row) with exact sums, which the kernel's fp32 conversion of
each sub-block's integer dot can round (kernels/csrc/q6k_linear.cpp).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels import native
from kernels.ggml_dequant import BLOCKS
from kernels.linear import PackedLinear
from kernels.quant_int4 import quantize_activations
from kernels.quantized_tensor import QuantizedTensor

LAYOUT = "q8_0"
SB = 256  # weights per tile of the kernel
BLOCK = 32  # weights per Q8_0 block
_BLOCK_BYTES = BLOCKS["Q8_0"][1]  # 2 bytes of d, 32 of q


def fits(weight: object) -> bool:
    """Whether `weight` is a Q8_0 matrix this layout takes (K a whole number of tiles)."""
    return (isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q8_0"
            and len(weight.shape) == 2 and weight.shape[1] % SB == 0)


def _kernel_order(q: np.ndarray) -> np.ndarray:
    """q int8 [R, 256] -> [R, 256] in the kernel's order: run v's byte 2 g + b is element
    2 v + b of sub-block g (the Q6_K layout's vector order, kernels/quant_q6_k.py)."""
    r = q.shape[0]
    return q.reshape(r, 16, 8, 2).transpose(0, 2, 1, 3).reshape(r, SB)


def _from_kernel_order(qb: np.ndarray) -> np.ndarray:
    r = qb.shape[0]
    return qb.reshape(r, 8, 16, 2).transpose(0, 2, 1, 3).reshape(r, SB)


def pack(weight: QuantizedTensor, bias: torch.Tensor | None) -> PackedLinear:
    """A Q8_0 GGUF matrix [N, K], K % 256 == 0 -> the "q8_0" layout (module docstring)."""
    if not fits(weight):
        raise ValueError(f"the q8_0 layout takes Q8_0 GGUF blocks with K % {SB} == 0, got "
                         f"{getattr(weight, 'ggml_type', type(weight).__name__)} "
                         f"{list(getattr(weight, 'shape', ()))}")
    n, k = weight.shape
    data = np.asarray(weight.data).reshape(n, k // BLOCK, _BLOCK_BYTES)
    d = np.ascontiguousarray(data[..., :2]).view(np.float16).reshape(n, k // BLOCK)
    q = np.ascontiguousarray(data[..., 2:]).view(np.int8).reshape(-1, SB)
    qb = _kernel_order(q).reshape(n, k)
    return PackedLinear("int8", k, n, torch.from_numpy(np.ascontiguousarray(qb)), bias,
                        scales=torch.from_numpy(d.copy()), layout=LAYOUT)


def q_values(packed: PackedLinear) -> torch.Tensor:
    """The file's q as fp32 [N, K]."""
    n, k = packed.out_features, packed.in_features
    q = _from_kernel_order(packed.weight.numpy().reshape(-1, SB))
    return torch.from_numpy(q.astype(np.float32)).reshape(n, k)


def dequantize(packed: PackedLinear) -> torch.Tensor:
    """fp32 [N, K]: d * q, ggml's product and its one rounding."""
    n, k = packed.out_features, packed.in_features
    return (q_values(packed).reshape(n, -1, BLOCK) * packed.scales.float()[..., None]).reshape(n, k)


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """The kernel's arithmetic with exact sums: x rounded to int16 per row (xq = round(x / dx),
    dx = max|x| / 32767), each block's integer dot scaled by its d, times dx."""
    n, k = packed.out_features, packed.in_features
    xq, dx, _ = quantize_activations(x.float())
    dots = torch.einsum("mbi,nbi->mnb", xq.double().reshape(x.shape[0], -1, BLOCK),
                        q_values(packed).double().reshape(n, -1, BLOCK))  # exact integers
    y = (dots * packed.scales.double()[None]).sum(-1) * dx.double()[:, None]
    y = y.float()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def q8_0_linear_native(x: torch.Tensor, packed: PackedLinear, level: str | None = None) -> torch.Tensor:
    """x: [M, K] float -> [M, N] through kernels/csrc/q6k_linear.cpp's Q8_0 entry.
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    k = packed.in_features
    xf = native.fp32_rows(x, k)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    native.check(native.library(level).tandem_q8_0_linear(
        xf.data_ptr(), m, k, k, packed.weight.data_ptr(), packed.scales.data_ptr(), n,
        native.ptr(packed.bias), y.data_ptr(), n), "q8_0 linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
