"""RMSNorm, optionally fused with the residual add that precedes it.

    residual_out = x + residual          (when residual is given)
    y = residual_out / sqrt(mean(residual_out^2) + eps) * weight

Statistics are computed in fp32 whatever the input dtype. The Triton kernel reads x and
residual once and writes y and residual_out once (one program per token), instead of the four
passes the unfused torch version makes.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels._triton import HAS_TRITON, record_launch, tl, triton, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.float() if residual is None else x.float() + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), h.to(x.dtype)


def native_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    return (native.available() and all(t.dtype == torch.float32 and not t.is_cuda for t in tensors)
            and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1)))


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None,
                    level: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/csrc/rms_norm.cpp: one pass per token, fp32."""
    t, hidden = x.shape
    y = torch.empty(t, hidden)
    h = torch.empty(t, hidden) if residual is not None else x
    native.check(native.library(level).tandem_rms_norm(
        x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0, weight.data_ptr(), y.data_ptr(),
        h.data_ptr() if residual is not None else y.data_ptr(), t, hidden, eps), "rms norm")
    return y, h


def rms_norm_cpu(x, weight, eps, residual=None):
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype), h


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [T, H], unit column stride
        r_ptr,  # [T, H] residual (read only if HAS_RESIDUAL)
        w_ptr,  # [H] weight
        y_ptr,  # [T, H] out: normed, contiguous
        h_ptr,  # [T, H] out: x + residual, contiguous (written only if HAS_RESIDUAL)
        H, eps, stride_x, stride_r,
        HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + row * H + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
        inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * H + cols, (h * inv_rms * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAS_TRITON:
        raise RuntimeError("rms_norm_triton needs triton")
    t, h = x.shape
    assert x.stride(1) == 1 and weight.shape == (h,) and weight.is_contiguous()
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    y = torch.empty(t, h, dtype=x.dtype, device=x.device)
    h_out = torch.empty_like(y) if residual is not None else x
    block_h = triton.next_power_of_2(h)
    record_launch("rms_norm")
    _rms_norm_kernel[(t,)](
        x, residual if residual is not None else x, weight, y, h_out,
        h, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, num_warps=min(16, max(1, block_h // 256)),
    )
    return y, h_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H]. Returns (normed, x + residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    if native_supported(x, weight, residual):
        return rms_norm_native(x, weight, eps, residual)
    return rms_norm_cpu(x, weight, eps, residual)
