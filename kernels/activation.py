"""SiLU-and-multiply, the SwiGLU gate: out = silu(x[:, :I]) * x[:, I:].

CPU: the native kernel (kernels/csrc/silu_and_mul.cpp) for fp32 rows, which the native decode
layers (kernels/csrc/decode_layers.cpp) call too, so that a decode pass computes the same bits
through either; torch where the native kernels are unavailable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native
from kernels._triton import HAS_TRITON, record_launch, tl, triton, use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def native_supported(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and not x.is_cuda and x.shape[-1] % 2 == 0 and x.shape[-1] > 0
            and x.stride(-1) == 1 and native.available())


def silu_and_mul_native(x: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """x: fp32 [..., 2 I] with unit column stride -> [..., I]."""
    lead, two_i = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, two_i)
    y = torch.empty(x2.shape[0], two_i // 2)
    native.check(native.library(level).tandem_silu_and_mul(x2.data_ptr(), x2.shape[0], two_i // 2,
                                                           x2.stride(0), y.data_ptr()), "silu and mul")
    return y.reshape(*lead, two_i // 2)


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
    if native_supported(x):
        return silu_and_mul_native(x)
    return silu_and_mul_cpu(x)
