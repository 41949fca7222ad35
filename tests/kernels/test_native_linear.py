"""The native CPU linear kernels (kernels/csrc/int4_linear.cpp, int8_linear.cpp) against their
torch references, at every instruction-set level this host can run (kernels/native.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import native, quant_int4, quant_int8
from kernels.ggml_dequant import q4_k_groups
from kernels.linear import packed_linear_reference
from kernels.quantized_tensor import QuantizedTensor
from reliability.kquant_fixtures import quantize_k


def host_levels() -> list[str]:
    return list(native.LEVELS[: native.LEVELS.index(native.dispatch_level()) + 1])


LEVELS = host_levels()
# M: one row, every remainder of the 8-row tile, several tiles; (N, K): K not a multiple of 32
# (padded), the model's shapes, a long K.
ROWS = [1, 2, 3, 5, 7, 8, 9, 16, 33, 64]
# Tails of the last 16-group chunk: 2 groups alone (64), 3 (80, padded), 16 + 2 (576), 16 + 8
# (768) at half width; 16 + 9 (800) at full width; none (1536).
SHAPES = [(40, 64), (17, 80), (96, 576), (24, 768), (24, 800), (64, 1536)]


def test_this_host_runs_at_least_the_portable_and_its_own_level():
    assert LEVELS[0] == "default" and LEVELS[-1] == native.dispatch_level()
    for level in LEVELS:
        native.library(level)  # builds (or loads from the cache) without error


def q4_1_tensor(rows: int, cols: int, seed: int) -> QuantizedTensor:
    """Random but valid Q4_1 blocks: fp16 d > 0, fp16 m, random nibbles."""
    rng = np.random.default_rng(seed)
    g = cols // 32
    d = rng.uniform(0.001, 0.02, (rows, g, 1)).astype(np.float16)
    m = rng.uniform(-0.15, 0.0, (rows, g, 1)).astype(np.float16)
    qs = rng.integers(0, 256, (rows, g, 16), dtype=np.uint8)
    data = np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=-1).reshape(rows, -1)
    return QuantizedTensor("Q4_1", data, (rows, cols))


def test_q4_1_blocks_are_split_byte_for_byte_and_dequantize_exactly():
    qt = q4_1_tensor(24, 128, seed=0)
    packed = quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1")
    blocks = qt.data.reshape(24, 4, 20)
    assert np.array_equal(packed.scales.view(torch.uint8).numpy().reshape(24, 4, 2), blocks[..., 0:2])
    assert np.array_equal(packed.zeros.view(torch.uint8).numpy().reshape(24, 4, 2), blocks[..., 2:4])
    assert np.array_equal(quant_int4.from_chunk_order(packed.weight).numpy(), blocks[..., 4:])
    assert torch.equal(quant_int4.dequantize(packed), qt.dequantize())


@pytest.mark.parametrize("groups", [1, 2, 16, 18, 35])
def test_chunk_order_moves_each_byte_where_the_kernel_reads_it(groups):
    """Within a chunk of C groups (16, the row's last one fewer), byte 2 t + b of group g sits
    at 2 C t + 2 g + b (kernels/csrc/int4_linear.cpp); from_chunk_order undoes it."""
    nibbles = torch.randint(0, 256, (3, groups, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(groups))
    packed = quant_int4.to_chunk_order(nibbles)
    assert packed.shape == (3, groups * 16)
    for g in range(groups):
        start, c = 256 * (g // 16), min(16, groups - 16 * (g // 16))
        for i in range(16):
            t, b = divmod(i, 2)
            assert torch.equal(packed[:, start + 2 * c * t + 2 * (g % 16) + b], nibbles[:, g, i])
    assert torch.equal(quant_int4.from_chunk_order(packed), nibbles)


def test_q4_0_maps_to_q4_1_exactly():
    rng = np.random.default_rng(1)
    d = rng.uniform(0.001, 0.02, (8, 4, 1)).astype(np.float16)
    qs = rng.integers(0, 256, (8, 4, 16), dtype=np.uint8)
    qt = QuantizedTensor("Q4_0", np.concatenate([d.view(np.uint8), qs], axis=-1).reshape(8, -1), (8, 128))
    packed = quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1")
    assert torch.equal(quant_int4.dequantize(packed), qt.dequantize())


def test_q4_k_keeps_its_nibbles_in_the_q4_1_layout():
    """Q4_K's groups of 32 are repacked, not requantized: the same q, and per group the scale
    d * sc and offset -dmin * min rounded once to fp16."""
    w = np.random.default_rng(4).standard_normal((24, 512)).astype(np.float32) * 0.02
    qt = QuantizedTensor("Q4_K", quantize_k(w, "Q4_K"), w.shape)
    packed = quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1")
    q, scale, minus = q4_k_groups(qt.data)
    nibbles = quant_int4.from_chunk_order(packed.weight)  # byte i of a group: q_i | q_{16+i} << 4
    assert torch.equal(torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(24, -1), torch.from_numpy(q))
    assert torch.equal(packed.scales, torch.from_numpy(scale).half())
    assert torch.equal(packed.zeros, torch.from_numpy(-minus).half())
    exact = qt.dequantize()
    err = (quant_int4.dequantize(packed) - exact).abs().max()
    assert err <= 2.0**-10 * exact.abs().max()


@pytest.mark.parametrize("layout", quant_int4.Q4_1_LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_native_equals_its_reference(level, n, k, layout):
    gen = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=gen)
    packed = quant_int4.pack(torch.randn(n, k, generator=gen), bias, torch.device("cpu"), layout=layout)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        y = quant_int4.int4_linear_native(x, packed, level)
        ref = packed_linear_reference(x, packed)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("layout", quant_int4.Q4_1_LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", [64, 576, 768])
def test_a_short_tail_chunk_at_half_width_equals_the_full_width_chunk_bit_for_bit(level, k, layout):
    """A last chunk of <= 8 groups runs at half width (int4_linear.cpp row_tile): the layer
    padded with zero groups to whole chunks, which runs every chunk at full width, gives the
    same bits."""
    gen = torch.Generator().manual_seed(k)
    n, padded = 40, -(-k // 512) * 512
    w = torch.randn(n, k, generator=gen)
    short = quant_int4.pack(w, None, torch.device("cpu"), layout=layout)
    blocks = quant_int4.q4_1_blocks(w).reshape(n, k // 32, 20)
    zero_groups = np.zeros((n, (padded - k) // 32, 20), dtype=np.uint8)  # d = m = 0, q = 0
    full = quant_int4.pack_q4_1(np.concatenate([blocks, zero_groups], axis=1).reshape(n, -1),
                                padded, None, layout)
    for m in (1, 3, 8, 9):
        x = torch.randn(m, k, generator=gen) * 3
        xp = torch.nn.functional.pad(x, (0, padded - k))
        assert torch.equal(quant_int4.int4_linear_native(x, short, level),
                           quant_int4.int4_linear_native(xp, full, level))


@pytest.mark.parametrize("level", LEVELS)
def test_int4_native_on_gguf_blocks_is_close_to_the_float_weights(level):
    """The activation rounding (int16 per group of 32) keeps y within 1e-4 of x @ W^T."""
    qt = q4_1_tensor(48, 256, seed=2)
    packed = quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ qt.dequantize().double().t()
    y = quant_int4.int4_linear_native(x, packed, level)
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 1e-4


@pytest.mark.parametrize("level", LEVELS)
def test_int4a8_rounds_x_per_group_to_int8_and_no_further(level):
    """int8 per group of 32 costs at most half a step of 127 per group: y stays within the
    bound sum_g |w_g| * dx_g / 2 of x @ W^T, and is not the int16 kernel's answer."""
    qt = q4_1_tensor(48, 256, seed=2)
    a8 = quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1a8")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    w = qt.dequantize().double()
    exact = x.double() @ w.t()
    step = x.double().reshape(5, -1, 32).abs().amax(-1) / 127  # [5, G]
    bound = (w.abs().reshape(48, -1, 32).sum(-1) @ step.t()).t() / 2 + 1e-5  # [5, 48]
    y = quant_int4.int4_linear_native(x, a8, level).double()
    assert ((y - exact).abs() <= bound).all()
    int16 = quant_int4.int4_linear_native(x, quant_int4.pack(qt, None, torch.device("cpu"), layout="q4_1"), level)
    assert not torch.equal(y.float(), int16)


def test_int4a8_format_packs_the_int8_activation_layout():
    from kernels.linear import linear, pack_linear
    qt = q4_1_tensor(32, 128, seed=4)
    packed = pack_linear(qt, None, "int4a8", device="cpu")
    assert (packed.fmt, packed.layout) == ("int4a8", "q4_1a8")
    x = torch.randn(3, 128)
    torch.testing.assert_close(linear(x, packed), packed_linear_reference(x, packed), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", quant_int4.Q4_1_LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
def test_int4_native_zero_rows_and_zero_groups(level, layout):
    packed = quant_int4.pack(torch.randn(16, 64), None, torch.device("cpu"), layout=layout)
    x = torch.zeros(3, 64)
    x[1, :32] = 1.0  # one all-zero group beside a non-zero one
    torch.testing.assert_close(quant_int4.int4_linear_native(x, packed, level),
                               packed_linear_reference(x, packed), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_native_equals_its_reference(level, n, k):
    gen = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=gen)
    packed = quant_int8.pack(torch.randn(n, k, generator=gen), bias, torch.device("cpu"), layout="native")
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        y = quant_int8.int8_linear_native(x, packed, level)
        ref = packed_linear_reference(x, packed)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_native_refuses_a_bad_shape_with_a_clear_error():
    lib = native.library()
    y = torch.empty(1, 4)
    x = torch.randn(1, 48)
    w = torch.zeros(4, 24, dtype=torch.uint8)
    d = torch.zeros(4, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="int4 linear"):
        native.check(lib.tandem_int4_linear(x.data_ptr(), 1, 48, 48, w.data_ptr(), d.data_ptr(), d.data_ptr(),
                                            4, None, y.data_ptr(), 4), "int4 linear")


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler"):
        native._compiler()


def test_a_source_that_does_not_compile_is_a_clear_error(tmp_path, monkeypatch):
    broken = tmp_path / "csrc"
    broken.mkdir()
    for name in (*native.SOURCES, *native.HEADERS):
        (broken / name).write_text("this is not C++\n")
    monkeypatch.setattr(native, "CSRC", broken)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    with pytest.raises(native.NativeUnavailable, match="building the native kernels failed"):
        native._build("default")
    assert not list((tmp_path / "home" / "native").glob("*.so"))  # no half-written library left


def test_builds_of_one_library_take_turns_and_the_second_loads_the_first(tmp_path, monkeypatch):
    """Two builders at once (a prefill and a decode worker starting on a fresh cache): one
    compiles, the other waits on the lock and finds the installed library."""
    import threading
    import time

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    real, compiles = native._compile, []

    def slow_compile(*args):
        compiles.append(threading.get_ident())
        time.sleep(0.5)  # a window for the other builder to arrive
        real(*args)

    monkeypatch.setattr(native, "_compile", slow_compile)
    built = []
    threads = [threading.Thread(target=lambda: built.append(native._build("default"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(compiles) == 1 and len(built) == 2 and built[0] == built[1] and built[0].exists()


def test_without_native_kernels_the_cpu_layouts_are_aten_s(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    cpu = torch.device("cpu")
    assert quant_int4.default_layout(cpu) == "cpu"
    assert quant_int8.default_layout(cpu) == "cpu"
    g = torch.Generator().manual_seed(0)
    packed = quant_int4.pack(torch.randn(32, 64, generator=g), None, cpu)
    x = torch.randn(2, 64, generator=g)
    want = packed_linear_reference(x, packed)
    # aten's int4 kernel rounds activations (bf16) on some dispatch levels: an error of a few
    # 1e-3 of the output's scale, so the bound is relative to that scale, not absolute.
    torch.testing.assert_close(quant_int4.forward(x, packed), want, rtol=2e-2,
                               atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize("layout", quant_int4.Q4_1_LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n,k", [(40, 64), (96, 576), (64, 1536)])
def test_int4_native_rows_are_bit_equal_whatever_batch_they_share(level, n, k, layout):
    """Batch invariance: a row's output does not depend on the rows beside it, nor on where it
    falls in the kernel's 8-row tiles (batches 1, 3, 8 and 9, the row at every position)."""
    gen = torch.Generator().manual_seed(k)
    packed = quant_int4.pack(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen),
                             torch.device("cpu"), layout=layout)
    rows = torch.randn(9, k, generator=gen) * 2
    alone = [quant_int4.int4_linear_native(rows[i:i + 1], packed, level)[0] for i in range(9)]
    for batch in (3, 8, 9):
        for start in range(9 - batch + 1):
            y = quant_int4.int4_linear_native(rows[start:start + batch], packed, level)
            for i in range(batch):
                assert torch.equal(y[i], alone[start + i]), (batch, start, i)


GUARDED_CHILD = """
import ctypes, dataclasses, mmap, sys
import torch
from kernels import quant_int4
level, k, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
packed = quant_int4.pack(torch.randn(24, k, generator=torch.Generator().manual_seed(k)), None,
                         torch.device("cpu"), layout=layout)
nbytes, page = packed.weight.numel(), mmap.PAGESIZE
total = -(-nbytes // page) * page + page
region = mmap.mmap(-1, total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + total - page, page, 0) == 0  # PROT_NONE: a read there faults
weight = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=total - page - nbytes)
weight = weight.view(packed.weight.shape)
weight.copy_(packed.weight)
guarded = dataclasses.replace(packed, weight=weight)
for m in (1, 3, 9):
    x = torch.randn(m, k)
    assert torch.equal(quant_int4.int4_linear_native(x, guarded, level),
                       quant_int4.int4_linear_native(x, packed, level))
print("ok")
"""


@pytest.mark.parametrize("layout", quant_int4.Q4_1_LAYOUTS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("k", [64, 576, 800])
def test_the_last_rows_tail_is_read_without_a_byte_past_the_weights(level, k, layout):
    """A tail chunk's runs are read where they lie, 16 bytes at a time (int4_linear.cpp
    tail_runs): the matrix's last row must not read past the weights. Here the weights end
    where an unreadable page begins; a read past them would kill the child."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", GUARDED_CHILD, level, str(k), layout], cwd=root,
                         capture_output=True, text=True, timeout=120,
                         env=native.level_env(level, dict(os.environ)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])
