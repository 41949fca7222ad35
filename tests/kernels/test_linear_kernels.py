"""Linear formats: CPU fast paths vs their references and vs fp32, GGUF Q4 repack exactness, and
the Triton GEMM/GEMV kernels under the interpreter (fp32 / int8 inputs; see tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels import quant_int4, quant_int8, quant_w8a8
from kernels.linear import (FORMATS, PackedLinear, dequantize_packed, linear, linear_reference, pack_linear,
                            packed_linear_reference)
from kernels.quantized_tensor import QuantizedTensor
from reliability.kquant_fixtures import quantize_k

# Relative Frobenius error bounds, generous over what is measured (in the comments) so that
# they catch a wrong scale, a swapped nibble or a lost bias, not seed noise.
#   vs own reference (same quantized weights): int8/int4 CPU paths round activations and the
#   output to bf16 (~2.5e-3); w8a8 is exact int32 math (~1e-7).
#   vs fp32 linear (the quantization error itself): int8 ~7e-3, int4 ~8e-2, w8a8 ~1e-2.
REF_TOL = {"fp32": 1e-6, "bf16": 1e-2, "int8": 1e-2, "int4": 1e-2, "int4a8": 1e-2, "w8a8": 1e-5}
FP32_TOL = {"fp32": 1e-6, "bf16": 1e-2, "int8": 2e-2, "int4": 0.15, "int4a8": 0.15, "w8a8": 3e-2}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def gguf_tensor(w: np.ndarray, ggml_type: str) -> QuantizedTensor:
    w = w.astype(np.float32)
    data = (quantize_k(w, ggml_type) if ggml_type.endswith("_K")
            else quants.quantize(w, GGMLQuantizationType[ggml_type]))
    return QuantizedTensor(ggml_type, data.reshape(w.shape[0], -1), w.shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 96, 128), (33, 50, 70), (17, 192, 576), (64, 48, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_path_vs_reference_and_fp32(fmt, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(m, k, generator=g)
    packed = pack_linear(w, b, fmt)
    y = linear(x, packed)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert rel_err(y, packed_linear_reference(x, packed)) < REF_TOL[fmt]
    assert rel_err(y, linear_reference(x, w, b)) < FP32_TOL[fmt]


@pytest.mark.parametrize("fmt", ["int8", "int4", "w8a8"])
def test_leading_dims_and_bf16_activations(fmt):
    w = torch.randn(64, 96) / 10
    x = torch.randn(2, 3, 96)
    packed = pack_linear(w, None, fmt)
    y = linear(x, packed)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y.reshape(6, 64), linear(x.reshape(6, 96), packed))
    yb = linear(x.bfloat16(), packed)
    assert yb.dtype == torch.bfloat16 and rel_err(yb, y) < 1e-2


def test_bias_is_added_once():
    w = torch.randn(32, 64)
    b = torch.full((32,), 100.0)
    x = torch.randn(3, 64)
    for fmt in FORMATS:
        packed = pack_linear(w, b, fmt)
        diff = linear(x, packed) - linear(x, pack_linear(w, None, fmt))
        torch.testing.assert_close(diff, torch.full((3, 32), 100.0), atol=0.5, rtol=0.0)


def test_bad_arguments_raise_value_error():
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="unknown linear weight format"):
        pack_linear(w, None, "int3")
    with pytest.raises(ValueError, match="bias shape"):
        pack_linear(w, torch.zeros(15), "int8")
    with pytest.raises(ValueError, match="smooth"):
        pack_linear(w, None, "int8", smooth=torch.ones(32))
    with pytest.raises(ValueError, match="features"):
        linear(torch.randn(2, 31), pack_linear(w, None, "fp32"))
    bogus = PackedLinear("nf4", 32, 16, w)
    with pytest.raises(ValueError, match="unknown linear weight format"):
        linear(torch.randn(2, 32), bogus)
    with pytest.raises(ValueError, match="int4 repack needs Q4_0, Q4_1, Q4_K"):
        quant_int4.int4_from_gguf(gguf_tensor(np.random.randn(16, 32), "Q8_0"))


# ---- int4 and GGUF -------------------------------------------------------------------------

@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q4_0", "Q4_K"])
def test_gguf_q4_repack_is_integer_exact(ggml_type):
    rng = np.random.default_rng(7)
    k = 512 if ggml_type == "Q4_K" else 96
    w = rng.standard_normal((48, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (48, 1)).astype(np.float32)
    qt = gguf_tensor(w, ggml_type)
    expected = qt.dequantize()
    groups = quant_int4.int4_from_gguf(qt)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    idx = torch.arange(k) // quant_int4.GROUP_SIZE
    # In fp32 the (q - 8) * scale + zero convention reproduces the GGUF values (only the rounding
    # of d * q + m versus (q - 8) * d + (m + 8d) can differ, by an ulp).
    recon = (groups.q.float() - 8.0) * groups.scales[:, idx] + groups.zeros[:, idx]
    torch.testing.assert_close(recon, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("layout", ["cpu", "nibbles"])
def test_gguf_q4_through_int4_kernel(ggml_type, layout):
    rng = np.random.default_rng(3)
    n, k = 40, 256  # n not a multiple of 16: the CPU layout pads rows
    w = rng.standard_normal((n, k)).astype(np.float32)
    qt = gguf_tensor(w, ggml_type)
    expected = qt.dequantize()
    groups = quant_int4.int4_from_gguf(qt)
    packed = quant_int4.pack_groups(groups, k, None, torch.device("cpu"), layout)
    # The nibbles survive packing bit for bit.
    assert torch.equal(quant_int4.unpack_q(packed)[:n], groups.q)
    # Only scale and zero are rounded to bf16: bound the error elementwise by that rounding.
    idx = torch.arange(k) // quant_int4.GROUP_SIZE
    d, z = groups.scales[:, idx], groups.zeros[:, idx]
    bound = ((groups.q.float() - 8.0).abs() * d.abs() + z.abs()) * 2.0**-8 + 1e-7
    err = (dequantize_packed(packed) - expected).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # The kernel (aten CPU int4 or the dequantize fallback) multiplies by those weights.
    x = torch.from_numpy(rng.standard_normal((7, k)).astype(np.float32))
    y = linear(x, packed)
    assert rel_err(y, x @ expected.t()) < 1e-2


def test_quantized_tensor_into_other_formats_dequantizes_first():
    w = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    qt = gguf_tensor(w, "Q4_1")
    deq = qt.dequantize()
    assert torch.equal(pack_linear(qt, None, "fp32").weight, deq)
    x = torch.randn(4, 64)
    for fmt in ("int8", "w8a8"):
        assert rel_err(linear(x, pack_linear(qt, None, fmt)), x @ deq.t()) < 3e-2
    # A non-Q4 GGUF type into int4 is dequantized and requantized.
    q8 = gguf_tensor(w, "Q8_0")
    assert rel_err(linear(x, pack_linear(q8, None, "int4")), x @ q8.dequantize().t()) < 0.15


def test_int4_cpu_layout_unpack_matches_quantized_values():
    w = torch.randn(64, 96)
    groups = quant_int4.quantize_int4(w)
    packed = quant_int4.pack_groups(groups, 96, None, torch.device("cpu"), "cpu")
    assert torch.equal(quant_int4.unpack_q(packed), groups.q)


def test_int8_fallback_layout_matches_cpu_layout():
    w, x = torch.randn(48, 80), torch.randn(5, 80)
    cpu = quant_int8.pack(w, None, torch.device("cpu"), "cpu")
    fallback = quant_int8.pack(w, None, torch.device("cpu"), "triton")  # no CUDA: dequantize path
    assert rel_err(linear(x, fallback), linear(x, cpu)) < 1e-2


# ---- w8a8 ----------------------------------------------------------------------------------

def test_w8a8_matches_integer_math_exactly():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 72, generator=g), torch.randn(9, 72, generator=g)
    packed = pack_linear(w, None, "w8a8")
    qx, sx = quant_w8a8.quantize_per_token(x)
    qw = packed.weight[:40, :72].long()
    expected = (qx.long() @ qw.t()).double() * sx.double()[:, None] * packed.scales.double()[None, :]
    torch.testing.assert_close(linear(x, packed).double(), expected, rtol=1e-6, atol=1e-5)


def test_smoothquant_helps_with_activation_outliers():
    g = torch.Generator().manual_seed(5)
    k = 256
    w = torch.randn(128, k, generator=g) / k**0.5
    channel_gain = torch.ones(k)
    channel_gain[torch.randperm(k, generator=g)[:4]] = 60.0  # a few outlier input channels
    calib = torch.randn(64, k, generator=g) * channel_gain
    x = torch.randn(16, k, generator=g) * channel_gain
    ref = x @ w.t()
    plain = pack_linear(w, None, "w8a8")
    smooth = pack_linear(w, None, "w8a8", smooth=calib.abs().amax(0), smooth_alpha=0.5)
    assert smooth.act_scale is not None and smooth.act_scale.shape == (k,)
    torch.testing.assert_close(dequantize_packed(smooth), w, rtol=0.0, atol=0.05)  # 1/s folded back
    err_plain, err_smooth = rel_err(linear(x, plain), ref), rel_err(linear(x, smooth), ref)
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)
    with pytest.raises(ValueError, match="smooth_alpha"):
        pack_linear(w, None, "w8a8", smooth=calib.abs().amax(0), smooth_alpha=1.5)
    with pytest.raises(ValueError, match="smooth has shape"):
        pack_linear(w, None, "w8a8", smooth=torch.ones(k + 1))


# ---- Triton kernels under the interpreter ---------------------------------------------------

TRITON_SHAPES = [(1, 64, 64), (5, 96, 128), (33, 64, 70), (1, 96, 70), (17, 50, 128)]


@pytest.mark.parametrize("m,n,k", TRITON_SHAPES)
def test_triton_int8_weight_only(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = quant_int8.pack(w, b, torch.device("cpu"), "triton")  # fp32 scales, K padded to 16
    y = quant_int8.int8_linear_triton(x, packed.weight, packed.scales, b)
    torch.testing.assert_close(y, quant_int8.reference(x, packed), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,n,k", TRITON_SHAPES)
def test_triton_int4_weight_only(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if m != 1 else None
    packed = quant_int4.pack(w, b, torch.device("cpu"), "nibbles")  # K padded to the group size
    y = quant_int4.int4_linear_triton(x, packed.weight, packed.scales, packed.group_size, b)
    torch.testing.assert_close(y, quant_int4.reference(x, packed), rtol=1e-4, atol=1e-4)


def test_triton_int4_on_gguf_q4_1():
    w = np.random.default_rng(11).standard_normal((64, 96)).astype(np.float32)
    qt = gguf_tensor(w, "Q4_1")
    packed = quant_int4.pack(qt, None, torch.device("cpu"), "nibbles")
    x = torch.randn(3, 96)
    y = quant_int4.int4_linear_triton(x, packed.weight, packed.scales, packed.group_size, None)
    assert rel_err(y, x @ qt.dequantize().t()) < 1e-2


@pytest.mark.parametrize("m,k", [(1, 64), (5, 70), (33, 128)])
@pytest.mark.parametrize("smoothed", [False, True])
def test_triton_per_token_quantization(m, k, smoothed):
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g) * 3
    act_scale = torch.rand(k, generator=g) + 0.5 if smoothed else None
    kp = (k + 15) // 16 * 16
    q, s = quant_w8a8.quantize_per_token_triton(x, act_scale, kp)
    q_ref, s_ref = quant_w8a8.quantize_per_token(x, act_scale, kp)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0.0)
    diff = (q.int() - q_ref.int()).abs()
    # Rounding differs only on exact .5 ties (half away from zero vs half to even).
    assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1
    assert not q[:, k:].any()


@pytest.mark.parametrize("m,n,k", TRITON_SHAPES)
def test_triton_w8a8_gemm(m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    packed = pack_linear(w, b, "w8a8")
    qx, sx = quant_w8a8.quantize_per_token(x, None, packed.weight.shape[1])
    y = quant_w8a8.w8a8_gemm_triton(qx, sx, packed.weight, packed.scales, b, torch.float32)
    torch.testing.assert_close(y, quant_w8a8.reference(x, packed), rtol=1e-5, atol=1e-4)
