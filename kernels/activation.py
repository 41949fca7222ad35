"""SiLU-and-multiply, the SwiGLU gate: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, record_launch, tl, triton, use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,  # [T, 2I], unit column stride: gate = x[:, :I], up = x[:, I:]
        y_ptr,  # [T, I] out, contiguous
        I, stride_x,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
        tl.store(y_ptr + row * I + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul_triton needs triton")
    lead, two_i = x.shape[:-1], x.shape[-1]
    assert two_i % 2 == 0
    x2 = x.reshape(-1, two_i)
    assert x2.stride(1) == 1
    t, i = x2.shape[0], two_i // 2
    y = torch.empty(t, i, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(i))
    record_launch("silu_and_mul")
    _silu_and_mul_kernel[(t, triton.cdiv(i, block))](x2, y, i, x2.stride(0), BLOCK=block)
    return y.reshape(*lead, i)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> [T, I]."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_cpu(x)
