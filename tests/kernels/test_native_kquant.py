"""K-quant blocks read by the native kernels as the file stores them: Q4_K in the int4 format's
"q4_k"/"q4_ka8" layouts (kernels/csrc/int4_linear.cpp tandem_q4k_linear), Q6_K in the int8
format's "q6_k" layout (kernels/csrc/q6k_linear.cpp, kernels/quant_q6_k.py) and Q8_0 in its
"q8_0" layout (the same kernel's tiles, kernels/quant_q8_0.py). Against gguf's
own dequantizer (the weights are the file's, bit for bit), against each layout's torch
reference at every native level this host runs, across thread counts and tiles (bit-equal), and
as the parts of a stacked projection (kernels/linear.py stack_linear)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels import native, quant_int4, quant_int8, quant_q5_k, quant_q6_k, quant_q8_0
from kernels.ggml_dequant import k4_scales_mins, q4_k_q, q6_k_q
from kernels.linear import dequantize_packed, linear, pack_linear, packed_linear_reference, stack_linear
from kernels.quantized_tensor import QuantizedTensor
from reliability.kquant_fixtures import quantize_k

LEVELS = list(native.LEVELS[: native.LEVELS.index(native.dispatch_level()) + 1])
ROWS = [1, 2, 3, 5, 8, 9, 17]
# K: one super-block (a half-width tail chunk of 8 groups), whole chunks, 3 super-blocks (tail
# of 8 after a full chunk), the 1B's hidden size, its FFN width (22 super-blocks).
KS = [256, 512, 768, 2048, 5632]
CPU = torch.device("cpu")


def kquant(ggml_type: str, n: int, k: int, seed: int) -> QuantizedTensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    if ggml_type == "Q8_0":  # gguf's own quantizer (not a K-quant: no super-blocks)
        data = quants.quantize(w, GGMLQuantizationType.Q8_0)
        return QuantizedTensor("Q8_0", np.ascontiguousarray(data).reshape(n, -1), (n, k))
    return QuantizedTensor(ggml_type, quantize_k(w, ggml_type), (n, k))


def gguf_dequantize(qt: QuantizedTensor) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(qt.data, GGMLQuantizationType[qt.ggml_type]).reshape(qt.shape))


# Each K-quant layout: (ggml type, format module, layout, the native kernel's Python wrapper).
LAYOUTS = [("Q4_K", quant_int4, "q4_k", quant_int4.int4_linear_native),
           ("Q4_K", quant_int4, "q4_ka8", quant_int4.int4_linear_native),
           ("Q6_K", quant_int8, "q6_k", quant_q6_k.q6k_linear_native),
           ("Q8_0", quant_int8, "q8_0", quant_q8_0.q8_0_linear_native),
           ("Q5_K", quant_int8, "q5_k", quant_q5_k.q5k_linear_native)]


@pytest.mark.parametrize("ggml_type,module,layout,run", LAYOUTS, ids=[lay[2] for lay in LAYOUTS])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", KS)
def test_native_kernel_equals_its_layouts_reference(level, k, ggml_type, module, layout, run):
    n = 40
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen)
    packed = module.pack(kquant(ggml_type, n, k, seed=k), bias, CPU, layout=layout)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        ref = packed_linear_reference(x, packed)
        torch.testing.assert_close(run(x, packed, level), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("ggml_type,module,layout,run", [lay for lay in LAYOUTS if lay[2] != "q4_ka8"],
                         ids=[lay[2] for lay in LAYOUTS if lay[2] != "q4_ka8"])
@pytest.mark.parametrize("level", LEVELS)
def test_native_kernel_is_close_to_the_files_weights(level, ggml_type, module, layout, run):
    """The int16 rounding of x keeps y within 1e-4 of x @ W^T, W the file's own weights."""
    qt = kquant(ggml_type, 48, 2048, seed=5)
    packed = module.pack(qt, None, CPU, layout=layout)
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(6))
    exact = x.double() @ gguf_dequantize(qt).double().t()
    assert ((run(x, packed, level).double() - exact).abs().max() / exact.abs().max()).item() < 1e-4


# --- Q4_K --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", quant_int4.Q4_K_LAYOUTS)
def test_q4_k_layout_holds_the_files_integers_and_dequantizes_bit_for_bit(layout):
    qt = kquant("Q4_K", 24, 768, seed=1)
    packed = quant_int4.pack(qt, None, CPU, layout=layout)
    blocks = qt.data.reshape(24, 3, 144)
    nibbles = quant_int4.from_chunk_order(packed.weight)  # byte i of a group: q_i | q_{16+i} << 4
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(24, -1)
    assert torch.equal(q, torch.from_numpy(q4_k_q(blocks.reshape(-1, 144))).reshape(24, -1))
    sc, mn = k4_scales_mins(blocks[..., 4:16].reshape(-1, 12))
    assert np.array_equal(packed.scales[0].numpy(), sc.reshape(24, -1))
    assert np.array_equal(packed.scales[1].numpy(), mn.reshape(24, -1))
    assert np.array_equal(packed.zeros.view(torch.uint8).numpy().reshape(24, 3, 4), blocks[..., 0:4])
    assert torch.equal(quant_int4.dequantize(packed), gguf_dequantize(qt))
    # 16 + 2 + 0.5 bytes per 32 weights: 4.625 bits a weight (Q4_K itself: 4.5)
    nbytes = sum(t.numel() * t.element_size() for t in (packed.weight, packed.scales, packed.zeros))
    assert nbytes * 8 == 4.625 * 24 * 768


def test_q4_k_takes_its_own_layout_where_the_native_one_is_chosen(monkeypatch):
    """Wherever "q4_1" (or "q4_1a8") would be picked for a matrix, a Q4_K one gets "q4_k" (or
    "q4_ka8"); where aten's "cpu" layout is, it keeps that one (the host's choice)."""
    qt = kquant("Q4_K", 16, 256, seed=2)
    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "q4_1")
    assert quant_int4.pack(qt, None, CPU).layout == "q4_k"
    assert quant_int4.pack(qt, None, CPU, int8_activations=True).layout == "q4_ka8"
    assert quant_int4.pack(kquant("Q4_K", 16, 256, seed=2).dequantize(), None, CPU).layout == "q4_1"
    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "cpu")
    assert quant_int4.pack(qt, None, CPU).layout == "cpu"


def test_q4_k_layout_refuses_other_blocks_and_the_kernel_a_partial_super_block():
    with pytest.raises(ValueError, match="q4_k layout takes Q4_K GGUF blocks, got Q6_K"):
        quant_int4.pack(kquant("Q6_K", 8, 256, seed=0), None, CPU, layout="q4_k")
    with pytest.raises(ValueError, match="q4_k layout takes Q4_K GGUF blocks, got Tensor"):
        quant_int4.pack(torch.randn(8, 256), None, CPU, layout="q4_k")
    packed = quant_int4.pack(kquant("Q4_K", 8, 256, seed=0), None, CPU, layout="q4_k")
    out = torch.empty(1, 8)
    code = native.library().tandem_q4k_linear(torch.randn(1, 224).data_ptr(), 1, 224, 224,
                                              packed.weight.data_ptr(), packed.scales[0].data_ptr(),
                                              packed.scales[1].data_ptr(), packed.zeros.data_ptr(),
                                              8, None, out.data_ptr(), 8, 0)
    assert code == 1  # K must be whole super-blocks


# --- Q6_K --------------------------------------------------------------------------------------


def test_q6_k_kernel_order_is_a_permutation_of_the_files_values():
    q = np.random.default_rng(0).integers(0, 64, (7, 256), dtype=np.uint8)
    ordered = quant_q6_k._kernel_order(q)
    assert ordered.shape == (7, 192)
    assert np.array_equal(quant_q6_k._from_kernel_order(ordered), q)
    # Vector v's lane 2 g + b is element 2 v + b of sub-block g: spot-check the run bytes.
    for g, e in ((0, 0), (3, 5), (15, 15), (9, 2)):
        v, b = divmod(e, 2)
        lane = 2 * g + b
        byte = ordered[:, 32 * (v // 2) + lane]
        low = (byte >> 4) if v % 2 else (byte & 15)
        high = (ordered[:, 128 + 32 * (v // 4) + lane] >> (2 * (v % 4))) & 3
        assert np.array_equal(low | (high << 4), q[:, 16 * g + e])


def test_q6_k_layout_holds_the_files_blocks_and_dequantizes_bit_for_bit():
    qt = kquant("Q6_K", 20, 768, seed=3)
    packed = quant_int8.pack(qt, None, CPU, layout="q6_k")
    blocks = qt.data.reshape(20, 3, 210)
    assert np.array_equal(quant_q6_k._from_kernel_order(packed.weight.numpy().reshape(-1, 192)),
                          q6_k_q(blocks.reshape(-1, 210)))
    assert np.array_equal(packed.scales.numpy().view(np.uint8).reshape(20, 3, 16), blocks[..., 192:208])
    assert np.array_equal(packed.zeros.view(torch.uint8).numpy().reshape(20, 3, 2), blocks[..., 208:210])
    assert torch.equal(quant_int8.dequantize(packed), gguf_dequantize(qt))
    nbytes = sum(t.numel() * t.element_size() for t in (packed.weight, packed.scales, packed.zeros))
    assert nbytes == qt.data.nbytes  # 6.5625 bits a weight, as the file


def test_q6_k_takes_its_own_layout_where_the_native_int8_one_is_chosen(monkeypatch):
    qt = kquant("Q6_K", 16, 256, seed=4)
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "native")
    monkeypatch.setattr(native, "amx_available", lambda level=None: False)  # tiles: test_int4_amx.py
    assert quant_int8.pack(qt, None, CPU).layout == "q6_k"
    assert quant_int8.pack(kquant("Q4_K", 16, 256, seed=4), None, CPU).layout == "native"
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "triton")
    assert quant_int8.pack(qt, None, CPU).layout == "triton"
    with pytest.raises(ValueError, match="q6_k layout takes Q6_K GGUF blocks, got Q4_K"):
        quant_int8.pack(kquant("Q4_K", 8, 256, seed=0), None, CPU, layout="q6_k")


# --- Q8_0 --------------------------------------------------------------------------------------


def test_q8_0_layout_holds_the_files_blocks_and_dequantizes_bit_for_bit():
    qt = kquant("Q8_0", 20, 768, seed=13)
    packed = quant_int8.pack(qt, None, CPU, layout="q8_0")
    blocks = qt.data.reshape(20, 24, 34)
    q = quant_q8_0._from_kernel_order(packed.weight.numpy().reshape(-1, 256)).reshape(20, 24, 32)
    assert np.array_equal(q.view(np.uint8), blocks[..., 2:])
    assert np.array_equal(packed.scales.view(torch.uint8).numpy().reshape(20, 24, 2), blocks[..., :2])
    assert torch.equal(quant_int8.dequantize(packed), gguf_dequantize(qt))
    nbytes = sum(t.numel() * t.element_size() for t in (packed.weight, packed.scales))
    assert nbytes == qt.data.nbytes  # 8.5 bits a weight, as the file
    # Run v's byte 2 g + b is element 2 v + b of sub-block g (of 16) within each 256 weights.
    ordered = packed.weight.numpy().reshape(-1, 256)
    flat = q.reshape(-1, 256)
    for g, e in ((0, 0), (3, 5), (15, 15), (9, 2)):
        v, b = divmod(e, 2)
        assert np.array_equal(ordered[:, 32 * v + 2 * g + b], flat[:, 16 * g + e])


def test_q8_0_takes_its_own_layout_where_the_native_int8_one_is_chosen(monkeypatch):
    """Only where K is whole tiles of 256: other Q8_0 matrices (a 576-wide SmolLM2) keep the
    per-row "native" layout."""
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "native")
    assert quant_int8.pack(kquant("Q8_0", 16, 512, seed=4), None, CPU).layout == "q8_0"
    odd = QuantizedTensor("Q8_0", np.ascontiguousarray(quants.quantize(
        np.ones((4, 576), np.float32), GGMLQuantizationType.Q8_0)).reshape(4, -1), (4, 576))
    assert not quant_q8_0.fits(odd) and quant_int8.pack(odd, None, CPU).layout == "native"
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "triton")
    assert quant_int8.pack(kquant("Q8_0", 16, 512, seed=4), None, CPU).layout == "triton"
    with pytest.raises(ValueError, match="q8_0 layout takes Q8_0 GGUF blocks with K % 256 == 0, got Q6_K"):
        quant_int8.pack(kquant("Q6_K", 8, 256, seed=0), None, CPU, layout="q8_0")
    with pytest.raises(ValueError, match=r"got Q8_0 \[4, 576\]"):
        quant_int8.pack(odd, None, CPU, layout="q8_0")


# --- Q5_K --------------------------------------------------------------------------------------


def test_q5_k_layout_holds_the_files_blocks_and_dequantizes_bit_for_bit():
    qt = kquant("Q5_K", 20, 768, seed=15)
    packed = quant_int8.pack(qt, None, CPU, layout="q5_k")
    blocks = qt.data.reshape(20, 3, 176)
    q = quant_q6_k._from_kernel_order(packed.weight.numpy().reshape(-1, 192))
    assert q.max() < 32 and np.array_equal(q, quant_q5_k.q5_k_q(blocks.reshape(-1, 176)))
    sc, mn = k4_scales_mins(blocks[..., 4:16].reshape(-1, 12))
    assert np.array_equal(packed.scales[0].numpy(), sc.reshape(20, -1))
    assert np.array_equal(packed.scales[1].numpy(), mn.reshape(20, -1))
    assert np.array_equal(packed.zeros.view(torch.uint8).numpy().reshape(20, 3, 4), blocks[..., 0:4])
    assert torch.equal(quant_int8.dequantize(packed), gguf_dequantize(qt))
    nbytes = sum(t.numel() * t.element_size() for t in (packed.weight, packed.scales, packed.zeros))
    assert nbytes * 8 == 6.625 * 20 * 768  # 6 bits of q, a byte each of scale and min per 32, d, dmin


def test_q5_k_takes_its_own_layout_where_the_native_int8_one_is_chosen(monkeypatch):
    qt = kquant("Q5_K", 16, 256, seed=4)
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "native")
    assert quant_int8.pack(qt, None, CPU).layout == "q5_k"
    monkeypatch.setattr(quant_int8, "default_layout", lambda device: "cpu")
    assert quant_int8.pack(qt, None, CPU).layout == "cpu"
    with pytest.raises(ValueError, match="q5_k layout takes Q5_K GGUF blocks, got Q4_K"):
        quant_int8.pack(kquant("Q4_K", 8, 256, seed=0), None, CPU, layout="q5_k")


# --- all: tiles, threads, stacks ---------------------------------------------------------------


def _kernels():
    """(name, packed layer, native call) for each K-quant layout."""
    gen = torch.Generator().manual_seed(11)
    q4 = quant_int4.pack(kquant("Q4_K", 577, 2048, seed=9), torch.randn(577, generator=gen), CPU, layout="q4_k")
    q4a8 = quant_int4.pack(kquant("Q4_K", 100, 768, seed=9), None, CPU, layout="q4_ka8")
    q6 = quant_int8.pack(kquant("Q6_K", 577, 2048, seed=10), torch.randn(577, generator=gen), CPU, layout="q6_k")
    q8 = quant_int8.pack(kquant("Q8_0", 333, 1280, seed=14), torch.randn(333, generator=gen), CPU, layout="q8_0")
    q5 = quant_int8.pack(kquant("Q5_K", 200, 2048, seed=16), None, CPU, layout="q5_k")
    return [("q4_k", q4, quant_int4.int4_linear_native), ("q4_ka8", q4a8, quant_int4.int4_linear_native),
            ("q6_k", q6, quant_q6_k.q6k_linear_native), ("q8_0", q8, quant_q8_0.q8_0_linear_native),
            ("q5_k", q5, quant_q5_k.q5k_linear_native)]


@pytest.mark.parametrize("level", LEVELS)
def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count(level):
    """Batch invariance: each row of x gives the same bits alone, in a batch of 3 or of 8, or
    split over 2 and 4 threads (each output computed by one thread, in the serial order)."""
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(12))
    try:
        for name, packed, run in _kernels():
            xk = x[:, :packed.in_features]
            alone = torch.cat([run(xk[i:i + 1], packed, level) for i in range(8)])
            assert torch.equal(run(xk[:3], packed, level), alone[:3]), name
            assert torch.equal(run(xk, packed, level), alone), name
            for threads in (2, 4):
                native.set_threads(threads)
                assert torch.equal(run(xk, packed, level), alone), (name, threads)
            native.set_threads(1)
    finally:
        native.set_threads(1)


def test_a_stacked_projection_is_its_parts_side_by_side():
    """Q4_K_M's q|k|v of a layer whose v is Q6_K: each part in its own exact layout, the stack's
    output their outputs in order, its reference and weights their references and weights."""
    parts = [kquant("Q4_K", 64, 512, seed=20), kquant("Q4_K", 32, 512, seed=21), kquant("Q6_K", 32, 512, seed=22)]
    bias = torch.randn(128, generator=torch.Generator().manual_seed(23))
    packed = [pack_linear(p, b, f, device=CPU) for p, b, f in zip(parts, bias.split([64, 32, 32]),
                                                                    ("int4", "int4", "int8"))]
    stack = stack_linear(packed)
    assert (stack.fmt, stack.in_features, stack.out_features) == ("stack", 512, 128)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(24))
    assert torch.equal(linear(x, stack), torch.cat([linear(x, p) for p in packed], dim=-1))
    assert torch.equal(packed_linear_reference(x, stack),
                       torch.cat([packed_linear_reference(x, p) for p in packed], dim=-1))
    assert torch.equal(dequantize_packed(stack), torch.cat([dequantize_packed(p) for p in packed]))
    with pytest.raises(ValueError, match="share in_features"):
        stack_linear([packed[0], pack_linear(torch.randn(8, 256), None, "int8", device=CPU)])
