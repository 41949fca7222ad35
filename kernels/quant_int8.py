"""Weight-only int8 linear, per-output-channel symmetric: the simple decode format.

    w[n, k] ~= q[n, k] * scale[n],   q in -127..127,   scale[n] = max_k |w[n, k]| / 127

Decode reads every weight once per step, so half the bytes of bf16 is half the step's memory
time. Activations stay 16-bit (weight-only); accumulation is fp32; the scale is applied once per
output in the epilogue, so the inner loop is a plain int8 -> float dot product.

Layouts (PackedLinear.layout), chosen by the device given to pack():
    "native": q int8 [N, Kp], scales fp32 [N], read by the native CPU kernel
              (kernels/csrc/int8_linear.cpp), which rounds each row of x to int16 (one scale
              per row, dx = max|x| / 32767) for an integer dot product; `reference` is that
              formula. The CPU default wherever the native kernels build. Kp = round_up(K, 16).
    "cpu":    q int8 [N, Kp], scales bf16 [N] for aten._weight_int8pack_mm(x bf16, q, scales).
              Measured (torch 2.13, AVX-512): that kernel returns garbage for K % 16 != 0 and
              crashes for some odd K, so K is zero-padded to Kp = round_up(K, 16) at pack time.
              Its scales must share x's dtype (bf16), so they are rounded to bf16 before q is
              computed against them (q absorbs the rounding).
    "triton": q int8 [N, Kp], scales fp32 [N], read by the Triton kernel below. Without Triton
              on the device, falls back to dequantize-on-the-fly + a dense bf16 matmul.
    "q6_k":   a GGUF Q6_K matrix's own blocks (6-bit q, a scale per 16 weights), reordered for
              the native kernel (kernels/quant_q6_k.py, kernels/csrc/q6k_linear.cpp): where
              the "native" layout would be chosen, a Q6_K matrix takes this one instead, so
              it is read at 6.5625 bits a weight and never requantized.
    "q6_kx":  the same values in AMX tile order (kernels/quant_q6_k.py `default_layout`): where
              the CPU and OS grant AMX tiles, the rows are whole blocks of 16 and the host's
              measurement picks it.
    "q5_k":   a GGUF Q5_K matrix's own 5-bit q, sub-block scales and mins (kernels/quant_q5_k.py,
              the same kernel): where "native" would be chosen, so a Q5_K_M file is read at
              6.625 bits a weight with the file's values, not requantized to 8.
    "q8_0":   a GGUF Q8_0 matrix's own blocks (int8 q, an fp16 d per 32 weights) in the same
              kernel's tile order (kernels/quant_q8_0.py): where "native" would be chosen, a
              Q8_0 matrix whose K is a multiple of 256 takes this one, so it keeps the file's
              values and scales (8.5 bits a weight) instead of one scale a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import batch_invariance, native, quant_q5_k, quant_q6_k, quant_q8_0
from kernels._triton import (HAS_TRITON, activation_dtype, gemm_tiles, record_launch, tl, triton, triton_layouts,
                             use_triton)
from kernels.linear import PackedLinear, float_row_chunks, linear_reference
from kernels.quant_int4 import quantize_activations
from kernels.quantized_tensor import QuantizedTensor

K_ALIGN = 16
# aten's int8 kernel costs ~50 us per row at N=1536, K=576 (one Zen 4 core, torch 2.13) while a
# dense bf16 matmul amortizes over rows: from this many rows on, dequantizing to bf16 once and
# calling the dense GEMM is faster (measured crossover between 32 and 64 rows; 5x at 512).
CPU_DENSE_MIN_ROWS = 48
# The native GEMV kernel's cost grows linearly with rows; from this many rows on dequantizing
# and running the fp32 GEMM is faster (measured at N=3072, K=576, one core: 2.3 vs 2.1 ms at
# 48 rows, 6.0 vs 3.5 at 128), and it computes exactly the format's reference.
NATIVE_DENSE_MIN_ROWS = 48


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def quantize_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (q int8 [N, K], scales [N] in scale_dtype), symmetric per row."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(scale_dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def pack(weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, device: torch.device,
         layout: str | None = None) -> PackedLinear:
    """layout: "native", "cpu" or "triton"; default by device (module docstring)."""
    out_features, in_features = weight.shape
    if layout is None:
        layout = default_layout(device)
        if layout == "native" and isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q6_K":
            layout = quant_q6_k.default_layout(out_features)
        elif layout == "native" and quant_q8_0.fits(weight):
            layout = quant_q8_0.LAYOUT
        elif layout == "native" and isinstance(weight, QuantizedTensor) and weight.ggml_type == "Q5_K":
            layout = quant_q5_k.LAYOUT
    if layout in quant_q6_k.LAYOUTS:
        return quant_q6_k.pack(weight, bias, layout)
    if layout == quant_q8_0.LAYOUT:
        return quant_q8_0.pack(weight, bias)
    if layout == quant_q5_k.LAYOUT:
        return quant_q5_k.pack(weight, bias)
    if layout not in ("native", "cpu", "triton"):
        raise ValueError(f"unknown int8 layout {layout!r}")
    scale_dtype = torch.bfloat16 if layout == "cpu" else torch.float32
    # Row by row, so one chunk of rows at a time (kernels/linear.py float_row_chunks).
    q = torch.zeros(out_features, _round_up(in_features, K_ALIGN), dtype=torch.int8)
    scales = torch.empty(out_features, dtype=scale_dtype)
    for r0, w in float_row_chunks(weight):
        r1 = r0 + w.shape[0]
        q[r0:r1, :in_features], scales[r0:r1] = quantize_int8(w, scale_dtype)
    return PackedLinear("int8", in_features, out_features, q.to(device).contiguous(), bias,
                        scales=scales.to(device).contiguous(), layout=layout)


def default_layout(device: torch.device) -> str:
    if device.type == "cuda" or triton_layouts(device):
        return "triton"
    return "native" if native.available() else "cpu"


# a GGUF type's own blocks, each read by its native kernel (forward) and defined by its module
_BLOCK_LAYOUTS = {quant_q6_k.LAYOUT: (quant_q6_k, quant_q6_k.q6k_linear_native),
                  quant_q6_k.AMX_LAYOUT: (quant_q6_k, quant_q6_k.q6k_linear_native),
                  quant_q8_0.LAYOUT: (quant_q8_0, quant_q8_0.q8_0_linear_native),
                  quant_q5_k.LAYOUT: (quant_q5_k, quant_q5_k.q5k_linear_native)}


def dequantize(packed: PackedLinear) -> torch.Tensor:
    if packed.layout in _BLOCK_LAYOUTS:
        return _BLOCK_LAYOUTS[packed.layout][0].dequantize(packed)
    return packed.weight[:, :packed.in_features].float() * packed.scales.float()[:, None]


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    if packed.layout in _BLOCK_LAYOUTS:
        return _BLOCK_LAYOUTS[packed.layout][0].reference(x, packed)
    if packed.layout != "native":
        return linear_reference(x, dequantize(packed), packed.bias)
    # The native kernel's definition: y = dx[r] * scale[n] * (q[n] . xq[r]), x rounded to int16
    # per row (the int4 kernel's weight-only rounding, kernels/quant_int4.py).
    k = packed.in_features
    xq, dx, _ = quantize_activations(F.pad(x.float(), (0, -k % 32)))
    dots = xq[:, :k].double() @ packed.weight[:, :k].double().t()  # exact integers
    y = (dots * dx.double()[:, None] * packed.scales.double()[None]).float()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def forward(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x: [M, K] -> [M, N] in x's dtype."""
    if packed.layout == "native" or packed.layout in _BLOCK_LAYOUTS:
        # The tile layout has no cut-over: it builds each weight tile once per pass, whatever M.
        if (x.shape[0] >= NATIVE_DENSE_MIN_ROWS and packed.layout != quant_q6_k.AMX_LAYOUT
                and not batch_invariance.enabled()):
            return linear_reference(x, dequantize(packed), packed.bias)
        if packed.layout in _BLOCK_LAYOUTS:
            return _BLOCK_LAYOUTS[packed.layout][1](x, packed)
        return int8_linear_native(x, packed)
    if packed.layout == "cpu":
        return int8_linear_cpu(x, packed.weight, packed.scales, packed.bias)
    if use_triton(x):
        return int8_linear_triton(x.to(activation_dtype(x)), packed.weight, packed.scales, packed.bias).to(x.dtype)
    y = F.linear(x.to(torch.bfloat16), dequantize(packed).to(torch.bfloat16)).float()
    return (y if packed.bias is None else y + packed.bias).to(x.dtype)


def int8_linear_native(x: torch.Tensor, packed: PackedLinear, level: str | None = None) -> torch.Tensor:
    """x: [M, K] float -> [M, N]; fp32 activations into kernels/csrc/int8_linear.cpp.
    level: the native build to run (kernels/native.py; default: this process's dispatch level)."""
    q = packed.weight
    kp = q.shape[1]
    xf = native.fp32_rows(x, kp)
    m, n = xf.shape[0], packed.out_features
    y = torch.empty(m, n)
    native.check(native.library(level).tandem_int8_linear(
        xf.data_ptr(), m, kp, kp, q.data_ptr(), n, kp, packed.scales.data_ptr(),
        native.ptr(packed.bias), y.data_ptr(), n), "int8 linear")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int8_linear_cpu(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] float; q: int8 [N, Kp]; scales: bf16 [N]; bias: fp32 [N] -> [M, N] in x's dtype."""
    xb = x.to(torch.bfloat16)
    if xb.shape[1] != q.shape[1]:
        xb = F.pad(xb, (0, q.shape[1] - xb.shape[1]))
    if xb.shape[0] >= CPU_DENSE_MIN_ROWS and not batch_invariance.enabled():
        y = F.linear(xb, q.to(torch.bfloat16) * scales[:, None])
    else:
        y = torch.ops.aten._weight_int8pack_mm(xb.contiguous(), q, scales)
    if bias is not None:
        y = y.float() + bias
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _int8_weight_only_kernel(
        x_ptr,  # [M, K] activations (fp32/fp16/bf16), unit column stride
        w_ptr,  # [N, Kp] int8, unit column stride, zero past K
        s_ptr,  # [N] fp32 per-output-channel scales
        b_ptr,  # [N] fp32 bias (read only if HAS_BIAS)
        y_ptr,  # [M, N] output, unit column stride
        M, N, K,
        stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BK, BN]
            if BLOCK_M == 1:
                # GEMV (decode): x as a [BK, 1] column, multiply and reduce over K.
                x = tl.load(x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + k[:, None],
                            mask=k_mask[:, None] & m_mask[None, :], other=0.0)
                acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=0)[None, :]
            else:
                x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
                acc += tl.dot(x, w.to(x.dtype))
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] float; q: int8 [N, Kp >= K]; scales: fp32 [N]; bias: fp32 [N] -> [M, N] in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("int8_linear_triton needs triton")
    m, k = x.shape
    n = q.shape[0]
    assert x.stride(1) == 1 and q.dtype == torch.int8 and q.stride(1) == 1 and q.shape[1] >= k
    assert scales.shape == (n,) and scales.dtype == torch.float32
    assert bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = gemm_tiles(m, x)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    record_launch("int8_gemm")
    _int8_weight_only_kernel[grid](
        x, q, scales, bias if bias is not None else scales, y,
        m, n, k, x.stride(0), q.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
