"""W8A8 linear: int8 weights, int8 activations, int32 accumulation: the prefill format.

Prefill is compute-bound, so both GEMM operands go to int8 (twice the bf16 tensor-core / VNNI
rate) and the sum over K is exact in int32:

    weights (pack time):  qw[n, k] = round(w[n, k] / sw[n]),  sw[n] = max_k |w[n, k]| / 127
    activations (per call, dynamic, per token):
                          qx[t, k] = round(x[t, k] / sx[t]),  sx[t] = max_k |x[t, k]| / 127
    y[t, n] = (sum_k qx[t, k] * qw[n, k]) * sx[t] * sw[n] + bias[n]

SmoothQuant (optional, `smooth` in pack): activations have outlier input channels that waste the
per-token int8 range, weights do not. Given per-input-channel activation statistics
a[j] = max |X[:, j]| over calibration data, and alpha (0.5 by default),

    s[j] = a[j]^alpha / max_n |W[n, j]|^(1 - alpha),    W' = W * s[None, :],   x' = x / s

leaves x' @ W'^T == x @ W^T exactly in real arithmetic while moving difficulty from activations
to weights. Here 1/s is kept as `act_scale` and multiplied into x inside the activation
quantization (fused in the Triton kernel); a model can instead fold 1/s into the preceding
RMSNorm weight and pack without it.

Padding: K is zero-padded to a multiple of 16 and N to a multiple of 8 (cuBLAS int8 rules;
harmless on CPU). torch._int_mm on CUDA also needs M > 16, so short inputs are padded with zero
rows there; the CPU kernel accepts any M (measured, torch 2.13).

Layout "int8": qw int8 [Np, Kp], sw fp32 [N], act_scale fp32 [K] or None. The same payload
serves the CPU path (torch._int_mm) and the Triton kernels; the dispatcher picks by device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, gemm_tiles, record_launch, tl, triton, use_triton
from kernels.linear import PackedLinear, float_row_chunks, to_float
from kernels.quantized_tensor import QuantizedTensor

K_ALIGN = 16
N_ALIGN = 8
_MIN_CUDA_INT_MM_ROWS = 17


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def smooth_scales(weight: torch.Tensor, act_absmax: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-channel s (fp32 [K]); weight: [N, K], act_absmax: [K]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_alpha must be in [0, 1], got {alpha}")
    if act_absmax.shape != (weight.shape[1],):
        raise ValueError(f"smooth has shape {tuple(act_absmax.shape)}, expected ({weight.shape[1]},)")
    a = act_absmax.float().abs().clamp(min=1e-5)
    w = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(min=1e-5)


def pack(weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, device: torch.device, *,
         smooth: torch.Tensor | None = None, smooth_alpha: float = 0.5) -> PackedLinear:
    out_features, in_features = weight.shape
    act_scale = None
    if smooth is not None:  # s depends on every row: the whole matrix in fp32 at once
        w = to_float(weight)
        s = smooth_scales(w, smooth.to(w.device), smooth_alpha)
        weight = w * s[None, :]
        act_scale = (1.0 / s).to(device).contiguous()
    # Row by row quantization, so packed one chunk of rows at a time (kernels/linear.py).
    q = torch.zeros(_round_up(out_features, N_ALIGN), _round_up(in_features, K_ALIGN), dtype=torch.int8)
    scales = torch.empty(out_features)
    for r0, w in float_row_chunks(weight):
        r1 = r0 + w.shape[0]
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[r0:r1, :in_features] = torch.round(w / s[:, None]).clamp_(-127, 127)  # w may be the caller's
        scales[r0:r1] = s
    return PackedLinear("w8a8", in_features, out_features, q.to(device).contiguous(), bias,
                        scales=scales.to(device).contiguous(), layout="int8", act_scale=act_scale)


def quantize_per_token(x: torch.Tensor, act_scale: torch.Tensor | None = None,
                       k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (int8 [M, k_padded or K], fp32 scales [M]); torch ops, any device."""
    xf = x.float() if act_scale is None else x.float() * act_scale
    scales = (xf.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(xf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    if k_padded is not None and k_padded != q.shape[1]:
        q = F.pad(q, (0, k_padded - q.shape[1]))
    return q, scales


def dequantize(packed: PackedLinear) -> torch.Tensor:
    """Effective fp32 [N, K] weights in x's space (SmoothQuant's 1/s folded back in)."""
    w = packed.weight[:packed.out_features, :packed.in_features].float() * packed.scales[:, None]
    return w if packed.act_scale is None else w * packed.act_scale[None, :]


def reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """fp32 torch: fake-quantize the activations per token, then a float matmul."""
    qx, sx = quantize_per_token(x, packed.act_scale)
    w = packed.weight[:packed.out_features, :packed.in_features].float() * packed.scales[:, None]
    y = (qx.float() * sx[:, None]) @ w.t()
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


def forward(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x: [M, K] -> [M, N] in x's dtype."""
    if use_triton(x):
        qx, sx = quantize_per_token_triton(x, packed.act_scale, packed.weight.shape[1])
        return w8a8_gemm_triton(qx, sx, packed.weight, packed.scales, packed.bias, x.dtype)
    return w8a8_linear_cpu(x, packed)


def w8a8_linear_cpu(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    qx, sx = quantize_per_token(x, packed.act_scale, packed.weight.shape[1])
    m = qx.shape[0]
    if qx.is_cuda and m < _MIN_CUDA_INT_MM_ROWS:
        qx = F.pad(qx, (0, 0, 0, _MIN_CUDA_INT_MM_ROWS - m))
    acc = torch._int_mm(qx, packed.weight.t())  # int32 [M, Np], exact
    n = packed.out_features
    y = acc[:m, :n].float() * sx[:, None] * packed.scales[None, :]
    if packed.bias is not None:
        y = y + packed.bias
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _quantize_per_token_kernel(
        x_ptr,  # [M, K] float activations, unit column stride
        a_ptr,  # [K] fp32 SmoothQuant act_scale (read only if HAS_ACT_SCALE)
        q_ptr,  # [M, KP] int8 out, zero past K
        s_ptr,  # [M] fp32 out, per-token scale
        K, KP, stride_xm, stride_qm,
        HAS_ACT_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        offs = tl.arange(0, BLOCK_K)
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 1: absmax
            k = k0 + offs
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            if HAS_ACT_SCALE:
                x = x * tl.load(a_ptr + k, mask=k < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / 127.0, 1e-10)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, KP, BLOCK_K):  # pass 2: quantize (round half away from zero)
            k = k0 + offs
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            if HAS_ACT_SCALE:
                x = x * tl.load(a_ptr + k, mask=k < K, other=0.0)
            v = x / scale
            q = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(q_ptr + row * stride_qm + k, q.to(tl.int8), mask=k < KP)

    @triton.jit
    def _w8a8_gemm_kernel(
        a_ptr,  # [M, KP] int8 activations, unit column stride
        w_ptr,  # [>=N, KP] int8 weights, unit column stride
        sx_ptr,  # [M] fp32 per-token scales
        sw_ptr,  # [N] fp32 per-channel scales
        b_ptr,  # [N] fp32 bias (read only if HAS_BIAS)
        y_ptr,  # [M, N] output, unit column stride
        M, N, KP,
        stride_am, stride_wn, stride_ym,
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
        a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am  # [BM, 1]
        w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, KP, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & (k < KP)[None, :], other=0)
            w = tl.load(w_cols + k[:, None], mask=(k < KP)[:, None] & n_mask[None, :], other=0)
            acc += tl.dot(a, w, out_dtype=tl.int32)
        sx = tl.load(sx_ptr + offs_m, mask=m_mask, other=0.0)
        sw = tl.load(sw_ptr + offs_n, mask=n_mask, other=0.0)
        y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quantize_per_token_triton(x: torch.Tensor, act_scale: torch.Tensor | None = None,
                              k_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] float -> (int8 [M, k_padded or K], fp32 [M]). Rounds half away from zero
    (torch.round, used on CPU, rounds half to even: they differ only on exact .5 ties)."""
    if not HAS_TRITON:
        raise RuntimeError("quantize_per_token_triton needs triton")
    m, k = x.shape
    kp = k if k_padded is None else k_padded
    assert x.stride(1) == 1 and kp >= k
    assert act_scale is None or (act_scale.shape == (k,) and act_scale.dtype == torch.float32)
    q = torch.empty(m, kp, dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    record_launch("quantize_per_token")
    _quantize_per_token_kernel[(m,)](
        x, act_scale if act_scale is not None else s, q, s, k, kp, x.stride(0), q.stride(0),
        HAS_ACT_SCALE=act_scale is not None, BLOCK_K=min(4096, triton.next_power_of_2(kp)),
    )
    return q, s


def w8a8_gemm_triton(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """qx: int8 [M, Kp]; sx: fp32 [M]; qw: int8 [>=N, Kp]; sw: fp32 [N]; bias: fp32 [N]
    -> [M, N] in out_dtype, N = len(sw)."""
    if not HAS_TRITON:
        raise RuntimeError("w8a8_gemm_triton needs triton")
    m, kp = qx.shape
    n = sw.shape[0]
    assert qx.dtype == torch.int8 and qw.dtype == torch.int8 and qx.stride(1) == 1 and qw.stride(1) == 1
    assert qw.shape[1] == kp and qw.shape[0] >= n and sx.shape == (m,)
    assert sx.dtype == torch.float32 and sw.dtype == torch.float32
    assert bias is None or (bias.shape == (n,) and bias.dtype == torch.float32)
    y = torch.empty(m, n, dtype=out_dtype, device=qx.device)
    block_m, block_n, block_k = gemm_tiles(max(m, 2), qx, max_block_m=128)  # tl.dot: >= 16 rows
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    record_launch("w8a8_gemm")
    _w8a8_gemm_kernel[grid](
        qx, qw, sx, sw, bias if bias is not None else sw, y,
        m, n, kp, qx.stride(0), qw.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y
