"""RMSNorm (+ fused residual), RoPE and SiLU-and-mul: CPU dispatch paths and Triton kernels (under
the interpreter, fp32) against the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul, silu_and_mul_reference, silu_and_mul_triton
from kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_triton
from kernels.rotary import apply_rotary, apply_rotary_reference, apply_rotary_triton


def rope_tables(max_pos: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("t,h", [(1, 64), (5, 576), (3, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(t, h, with_residual):
    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g) * 3
    residual = torch.randn(t, h, generator=g) if with_residual else None
    weight = torch.randn(h, generator=g)
    y_ref, h_ref = rms_norm_reference(x, weight, 1e-5, residual)
    for fn in (rms_norm, rms_norm_triton):  # CPU dispatch, then the Triton kernel
        y, h_out = fn(x, weight, 1e-5, residual)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h_out, h_ref, rtol=0.0, atol=0.0)


def test_rms_norm_triton_strided_input_and_eps():
    x_full = torch.randn(4, 256)
    x = x_full[:, :128]  # row stride 256
    weight = torch.ones(128)
    residual = torch.zeros(4, 128)
    y, h = rms_norm_triton(x, weight, 1.0, residual)
    y_ref, h_ref = rms_norm_reference(x, weight, 1.0, residual)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, h_ref)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (3, 1, 16)])
def test_rotary(hq, hkv, d):
    max_pos = 131072
    cos, sin = rope_tables(max_pos, d)
    positions = torch.tensor([0, 1, 17, 4095, 65536, max_pos - 1])
    t = len(positions)
    g = torch.Generator().manual_seed(hq * d)
    # q and k as views into a fused qkv projection output (strided rows), as the model has them.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    q_ref, k_ref = apply_rotary_reference(q, k, positions, cos, sin)
    for fn in (apply_rotary, apply_rotary_triton):
        q_out, k_out = fn(q, k, positions, cos, sin)
        torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; rotation preserves each pair's norm.
    torch.testing.assert_close(q_out[0], q[0])
    half = d // 2
    pair_norm = lambda x: x[..., :half] ** 2 + x[..., half:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(q_out), pair_norm(q), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(3, 2), (1, 14), (5, 2000), (2, 3, 2 * 1537)])
def test_silu_and_mul(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 4
    expected = silu_and_mul_reference(x)
    assert expected.shape == (*shape[:-1], shape[-1] // 2)
    for fn in (silu_and_mul, silu_and_mul_triton):
        torch.testing.assert_close(fn(x), expected, rtol=1e-5, atol=1e-5)


# The interpreter evaluates tl.sigmoid with numpy's exp, which warns on exp(100) in fp32 (the
# result, 0 after the division, is still right); the GPU's sigmoid does not overflow.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_and_mul_extreme_gates():
    x = torch.tensor([[-100.0, 0.0, 100.0, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(silu_and_mul_triton(x), torch.tensor([[-0.0, 0.0, 200.0]]), atol=1e-5, rtol=1e-6)
