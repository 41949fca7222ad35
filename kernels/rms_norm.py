"""RMSNorm, optionally fused with the residual add that precedes it.

    residual_out = x + residual          (when residual is given)
    y = residual_out / sqrt(mean(residual_out^2) + eps) * weight

Statistics are computed in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.float() if residual is None else x.float() + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype), h.to(x.dtype)


def rms_norm_cpu(x, weight, eps, residual=None):
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H]. Returns (normed, x + residual)."""
    return rms_norm_cpu(x, weight, eps, residual)
