"""SiLU-and-multiply, the SwiGLU gate: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> [T, I]."""
    return silu_and_mul_cpu(x)
