"""The native fused CPU ops (kernels/csrc/rms_norm.cpp, rotary_kv_write.cpp, silu_and_mul.cpp)
against their torch references, at every instruction-set level this host runs, and the
dispatchers that pick them."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.activation import silu_and_mul, silu_and_mul_native, silu_and_mul_reference
from kernels.rms_norm import rms_norm, rms_norm_native, rms_norm_reference
from kernels.rotary_kv_write import (rotary_kv_write, rotary_kv_write_native,
                                     rotary_kv_write_reference)

LEVELS = list(native.LEVELS[: native.LEVELS.index(native.dispatch_level()) + 1])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("t,hidden", [(1, 576), (7, 64), (3, 37), (130, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_native_equals_reference(level, t, hidden, with_residual):
    gen = torch.Generator().manual_seed(t * hidden)
    x = torch.randn(t, hidden, generator=gen) * 4
    residual = torch.randn(t, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    y, h = rms_norm_native(x, weight, 1e-5, residual, level)
    y_ref, h_ref = rms_norm_reference(x, weight, 1e-5, residual)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)


def test_rms_norm_native_reads_strided_rows():
    wide = torch.randn(5, 100)
    x = wide[:, 10:74]  # row stride 100
    weight = torch.randn(64)
    y, _ = rms_norm_native(x, weight, 1e-6)
    torch.testing.assert_close(y, rms_norm_reference(x, weight, 1e-6)[0], rtol=1e-5, atol=1e-5)


def rope_tables(max_pos: int, head_dim: int):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.arange(max_pos).float()[:, None] * inv[None]
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 16), (8, 2, 24)])
def test_rotary_kv_write_native_equals_reference(level, kv_dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(hq * d)
    t, nb, bs = 11, 6, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    positions = torch.randint(0, 300, (t,), generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[3] = -1  # padding: not written
    cos, sin = rope_tables(512, d)
    caches = [torch.randn(nb, bs, hkv, d, generator=gen).to(kv_dtype) for _ in range(2)]
    ours = [c.clone() for c in caches]
    q = rotary_kv_write_native(qkv, positions, cos, sin, ours[0], ours[1], slots, hq, hkv, d, level)
    q_ref = rotary_kv_write_reference(qkv, positions, cos, sin, caches[0], caches[1], slots, hq, hkv, d)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    # fp32: exact copies of the rotated values; bf16: the same round-to-nearest-even as torch.
    # (fp32 rotation may differ in the last bit from torch's fused order, which can flip a
    # bf16 rounding: allow one bf16 ulp there.)
    tol = {"rtol": 1e-6, "atol": 1e-6} if kv_dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
    torch.testing.assert_close(ours[0].float(), caches[0].float(), **tol)
    torch.testing.assert_close(ours[1], caches[1], rtol=0, atol=0)  # v is copied unrotated


def test_rotary_kv_write_refuses_out_of_range_positions_and_slots():
    cos, sin = rope_tables(16, 8)
    cache = torch.zeros(2, 4, 1, 8)
    qkv = torch.randn(1, 24)
    with pytest.raises(ValueError, match="out of range"):
        rotary_kv_write_native(qkv, torch.tensor([16]), cos, sin, cache, cache.clone(), torch.tensor([0]), 1, 1, 8)
    with pytest.raises(ValueError, match="out of range"):
        rotary_kv_write_native(qkv, torch.tensor([3]), cos, sin, cache, cache.clone(), torch.tensor([8]), 1, 1, 8)


def test_dispatchers_take_the_native_path_and_fall_back(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(64, 16)
    qkv = torch.randn(5, 6 * 16, generator=gen)
    positions, slots = torch.arange(5), torch.arange(5)
    results = []
    for available in (True, False):
        monkeypatch.setattr(native, "available", lambda a=available: a)
        caches = [torch.zeros(3, 4, 2, 16) for _ in range(2)]
        q = rotary_kv_write(qkv, positions, cos, sin, caches[0], caches[1], slots, 2, 2, 16)
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
        results.append((q, caches[0], rms_norm(x, torch.ones(16), 1e-6, x.clone())[0]))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("t,i", [(1, 1536), (3, 37), (8, 5632), (2, 16)])
def test_silu_and_mul_native_equals_reference(level, t, i):
    """Across the whole range of the gate (large negatives, where exp(-g) would overflow a
    naive sigmoid, and the vector body's and scalar tail's columns alike)."""
    gen = torch.Generator().manual_seed(t * i)
    wide = torch.randn(t, 2 * i + 5, generator=gen) * 30  # a row stride past 2 I
    x = wide[:, :2 * i]
    y = silu_and_mul_native(x, level)
    torch.testing.assert_close(y, silu_and_mul_reference(x), rtol=2e-6, atol=1e-6)
    edge = torch.tensor([[0.0, -0.0, 1e-30, -200.0, 200.0, float("inf"), 3.0, 3.0, 3.0, 3.0, 3.0, -3.0]])
    torch.testing.assert_close(silu_and_mul_native(edge, level), silu_and_mul_reference(edge),
                               rtol=2e-6, atol=0)


def test_silu_and_mul_takes_the_native_path_for_fp32_and_torch_otherwise(monkeypatch):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    native_y = silu_and_mul(x)
    assert torch.equal(native_y, silu_and_mul_native(x))
    monkeypatch.setattr(native, "available", lambda: False)
    torch.testing.assert_close(silu_and_mul(x), native_y, rtol=2e-6, atol=1e-6)
    assert silu_and_mul(x.to(torch.bfloat16)).dtype == torch.bfloat16
