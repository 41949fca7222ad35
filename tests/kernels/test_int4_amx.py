"""The "q4_1x", "q4_kx" and "q6_kx" layouts and their AMX tile kernel (kernels/csrc/int4_amx.cpp):
the packing is the "q4_1" (or "q4_k", "q6_k") layout's values in another order (tested on every
host); where this host's CPU and OS
grant AMX tiles, the kernel equals its reference, its rows are bit-equal whatever batch and
thread count they run at, and a model decodes the same bits natively and in the layer loop;
the layout is offered to the layout choice only where the tiles work.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from kernels import layout_choice, native, quant_int4, quant_int8, quant_q6_k
from kernels.linear import packed_linear_reference

CPU = torch.device("cpu")
AMX = native.available() and native.amx_available()
needs_amx = pytest.mark.skipif(not AMX, reason="this host's CPU or OS does not grant AMX tiles (or no "
                                               "native kernels): the tile kernel cannot run here")
# (N, K): one block; groups per block odd (K = 96: the pipeline's last step alone); a short
# tail of blocks; the default model's and a 1B model's shapes.
SHAPES = [(16, 32), (48, 96), (64, 576), (96, 1536), (256, 2048)]
ROWS = [1, 3, 8, 9, 17]


@pytest.fixture(autouse=True)
def serial_afterwards():
    yield
    native.set_threads(1)


def test_tile_order_holds_the_q4_1_layout_s_values():
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        tiles = quant_int4.pack(w, None, CPU, layout="q4_1x")
        chunks = quant_int4.pack(w, None, CPU, layout="q4_1")
        assert tiles.layout == "q4_1x" and tiles.weight.shape == chunks.weight.shape
        assert torch.equal(quant_int4.dequantize(tiles), quant_int4.dequantize(chunks))
        nibbles = quant_int4.from_chunk_order(chunks.weight)
        assert torch.equal(quant_int4.from_tile_order(quant_int4.to_tile_order(nibbles)), nibbles)


def test_q4_k_tiles_hold_the_q4_k_layout_s_values():
    from tests.kernels.test_native_kquant import kquant
    for n, k in [(16, 256), (48, 512), (32, 2048)]:
        qt = kquant("Q4_K", n, k, seed=n)
        tiles = quant_int4.pack(qt, None, CPU, layout="q4_kx")
        plain = quant_int4.pack(qt, None, CPU, layout="q4_k")
        assert tiles.layout == "q4_kx"
        assert torch.equal(quant_int4.dequantize(tiles), quant_int4.dequantize(plain))
        assert torch.equal(quant_int4.dequantize(tiles), qt.dequantize())  # the file's values, exactly


def test_tile_order_bytes_are_the_kernel_s():
    """Byte j of run c of block b, group g: q[16 b + j / 4][8 c + j % 4] | q[..][8 c + 4 + j % 4] << 4."""
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    nibbles = q.reshape(n, k // 32, 32)
    tiles = quant_int4.to_tile_order(nibbles[..., :16] | (nibbles[..., 16:] << 4)).reshape(-1)
    for b in range(n // 16):
        for g in range(k // 32):
            for c in range(4):
                for j in range(64):
                    row, kk = 16 * b + j // 4, 32 * g + 8 * c + j % 4
                    want = int(q[row, kk]) | int(q[row, kk + 4]) << 4
                    assert int(tiles[(b * (k // 32) + g) * 256 + 64 * c + j]) == want


def test_packing_rows_not_in_blocks_of_16_is_refused():
    w = torch.randn(40, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_int4.pack_q4_1x(quant_int4.q4_1_blocks(w), 64, None)


def test_q6_k_tiles_hold_the_q6_k_layout_s_values():
    from tests.kernels.test_native_kquant import kquant
    for n, k in [(16, 256), (48, 512), (32, 2048)]:
        qt = kquant("Q6_K", n, k, seed=n)
        tiles = quant_q6_k.pack(qt, None, "q6_kx")
        plain = quant_q6_k.pack(qt, None, "q6_k")
        assert tiles.layout == "q6_kx" and tiles.weight.shape == plain.weight.shape
        assert torch.equal(quant_q6_k.dequantize(tiles), quant_q6_k.dequantize(plain))
        assert torch.equal(quant_q6_k.dequantize(tiles), qt.dequantize())  # the file's values, exactly


def test_q6_tile_order_bytes_are_the_kernel_s():
    """Step (block b, sub-block s), 192 bytes: B tile row kk's byte j is q[16 b + j / 4][16 s +
    4 kk + j % 4]; its low 4 bits in byte j of run kk / 2 (low nibble for even kk), its high 2
    bits at bits 2 kk of byte 128 + j."""
    import numpy as np
    n, k = 32, 512
    q = np.random.default_rng(4).integers(0, 64, (n, k), dtype=np.uint8)
    tiles = quant_q6_k.to_tile_order(q)
    assert tiles.shape == (n, k * 3 // 4)
    assert np.array_equal(quant_q6_k.from_tile_order(tiles), q)
    flat = tiles.reshape(-1)
    for b in range(n // 16):
        for s in range(k // 16):
            step = flat[(b * (k // 16) + s) * 192:][:192]
            for kk in range(4):
                for j in range(64):
                    v = int(q[16 * b + j // 4, 16 * s + 4 * kk + j % 4])
                    assert (int(step[64 * (kk // 2) + j]) >> (4 * (kk % 2))) & 15 == v & 15
                    assert (int(step[128 + j]) >> (2 * kk)) & 3 == v >> 4


def test_q6_k_rows_not_in_blocks_of_16_keep_the_plain_layout(monkeypatch):
    from tests.kernels.test_native_kquant import kquant
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_q6_k.pack(kquant("Q6_K", 40, 256, seed=1), None, "q6_kx")
    monkeypatch.setattr(native, "amx_available", lambda level=None: True)
    monkeypatch.setattr(layout_choice, "fastest_layout", lambda fmt, candidates, *a, **kw: candidates[-1])
    assert quant_q6_k.default_layout(48) == "q6_kx"
    assert quant_q6_k.default_layout(40) == "q6_k"
    monkeypatch.setattr(native, "amx_available", lambda level=None: False)
    assert quant_q6_k.default_layout(48) == "q6_k"  # never offered where the tiles do not run
    monkeypatch.setattr(quant_q6_k, "default_layout", lambda n: "q6_kx")
    if native.available():  # the int8 format's Q6_K matrices take the choice
        assert quant_int8.pack(kquant("Q6_K", 48, 256, seed=1), None, CPU).layout == "q6_kx"


def test_the_choice_never_picks_tiles_it_cannot_run(monkeypatch):
    """Where the tiles are not granted, "q4_1x" is not a candidate; where it would be chosen,
    a matrix whose rows are not whole blocks, or a Q4_K matrix, takes its usual layout."""
    monkeypatch.setattr(native, "amx_available", lambda level=None: False)
    seen = []
    monkeypatch.setattr(layout_choice, "fastest_layout", lambda fmt, candidates, *a, **kw: seen.append(candidates)
                        or candidates[0])
    quant_int4.default_layout(CPU)
    if seen:
        assert "q4_1x" not in seen[0]
    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "q4_1x")
    assert quant_int4.pack(torch.randn(40, 64), None, CPU).layout == "q4_1"
    assert quant_int4.pack(torch.randn(48, 64), None, CPU).layout == "q4_1x"
    from tests.kernels.test_native_kquant import kquant
    assert quant_int4.pack(kquant("Q4_K", 16, 256, seed=2), None, CPU).layout == "q4_kx"
    assert quant_int4.pack(kquant("Q4_K", 40, 256, seed=2), None, CPU).layout == "q4_k"


def test_the_kernel_refuses_bad_shapes_with_a_code():
    if not native.available():
        pytest.skip("no native kernels built on this host")
    lib = native.library()
    x, y = torch.randn(1, 64), torch.empty(1, 40)
    w, d = torch.zeros(40, 32, dtype=torch.uint8), torch.zeros(40, 2, dtype=torch.float16)
    args = (x.data_ptr(), 1, 64, 64, w.data_ptr(), d.data_ptr(), d.data_ptr())
    assert lib.tandem_int4_amx_linear(x.data_ptr(), 1, 48, 48, w.data_ptr(), d.data_ptr(), d.data_ptr(),
                                      16, None, y.data_ptr(), 16) == 1  # K % 32
    assert lib.tandem_int4_amx_linear(*args, 40, None, y.data_ptr(), 40) == 2  # N % 16
    # Where this build or OS has no tiles, the kernel says so rather than dying on SIGILL.
    assert lib.tandem_int4_amx_linear(*args, 32, None, y.data_ptr(), 40) == (0 if AMX else 3)
    # Q6_K tiles: one block of 16 rows, K = 256 (192 bytes of q, 16 sc a row, one d)
    x6, w6 = torch.randn(1, 256), torch.zeros(16, 192, dtype=torch.uint8)
    sc, d6 = torch.zeros(16, 16, dtype=torch.int8), torch.zeros(16, 1, dtype=torch.float16)
    q6 = (x6.data_ptr(), 1, 256, 256, w6.data_ptr(), sc.data_ptr(), d6.data_ptr())
    assert lib.tandem_q6k_amx_linear(x6.data_ptr(), 1, 64, 64, w6.data_ptr(), sc.data_ptr(), d6.data_ptr(),
                                     16, None, y.data_ptr(), 16) == 1  # K % 256
    assert lib.tandem_q6k_amx_linear(*q6, 40, None, y.data_ptr(), 40) == 2  # N % 16
    assert lib.tandem_q6k_amx_linear(*q6, 16, None, y.data_ptr(), 40) == (0 if AMX else 3)


def _os_grants_tiles() -> bool:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked from Python (x86-64 Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0


def test_the_build_has_tiles_wherever_the_host_grants_them():
    """A compiler that took the AMX flags and a CPU and OS that grant the tiles: the kernel must
    be available (a source that stopped compiling with the flags would otherwise fall back
    silently, kernels/native.py)."""
    if not native.available() or native.dispatch_level() != "avx512vnni":
        pytest.skip("the tile kernel is built only at the avx512vnni level, which this process does not run")
    if not all(native._has_cpu_flag(f) for f in ("amx_tile", "amx_int8")) or not _os_grants_tiles():
        assert not native.amx_available()
        return
    import subprocess
    probe = subprocess.run([native._compiler(), "-mamx-tile", "-mamx-int8", "-x", "c++", "-fsyntax-only", "-"],
                           input="int main() { return 0; }", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("this compiler does not take -mamx-tile")
    assert native.amx_available()


def _tiles_and_plain(layout: str, n: int, k: int, seed: int, bias: torch.Tensor | None = None):
    """A matrix packed in a tile layout and in the plain layout it reorders, and the kernel."""
    from tests.kernels.test_native_kquant import kquant
    if layout == "q6_kx":
        qt = kquant("Q6_K", n, k, seed=seed)
        return (quant_q6_k.pack(qt, bias, "q6_kx"), quant_q6_k.pack(qt, bias, "q6_k"),
                quant_q6_k.q6k_linear_native)
    w = kquant("Q4_K", n, k, seed=seed) if layout == "q4_kx" else torch.randn(
        n, k, generator=torch.Generator().manual_seed(seed))
    return (quant_int4.pack(w, bias, CPU, layout=layout),
            quant_int4.pack(w, bias, CPU, layout={"q4_1x": "q4_1", "q4_kx": "q4_k"}[layout]),
            quant_int4.int4_linear_native)


@needs_amx
@pytest.mark.parametrize("tiles_layout,n,k", [("q4_1x", n, k) for n, k in SHAPES]
                         + [("q4_kx", 16, 256), ("q4_kx", 48, 512), ("q4_kx", 256, 2048)]
                         + [("q6_kx", 16, 256), ("q6_kx", 48, 768), ("q6_kx", 256, 2048)])
def test_amx_kernel_equals_its_reference_and_the_avx512_kernel(tiles_layout, n, k):
    """The same integer dots as "q4_1" / "q4_k" / "q6_k" (int16 activations): the outputs agree
    with the AVX-512 kernel's and the reference's to float rounding."""
    gen = torch.Generator().manual_seed(n * k)
    tiles, plain, run = _tiles_and_plain(tiles_layout, n, k, seed=k, bias=torch.randn(n, generator=gen))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        y = run(x, tiles)
        ref = packed_linear_reference(x, tiles)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        torch.testing.assert_close(y, run(x, plain), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_amx
@pytest.mark.parametrize("layout", ["q4_1x", "q6_kx"])
def test_prefill_sized_passes_stay_on_the_tiles(layout):
    """No dense cut-over for the tile layouts: 200 rows run the tile kernel (its bits), where
    the plain layouts would dequantize and run an fp32 GEMM."""
    packed, _, run = _tiles_and_plain(layout, 64, 768, seed=7)
    forward = quant_int4.forward if layout == "q4_1x" else quant_int8.forward
    x = torch.randn(200, 768, generator=torch.Generator().manual_seed(7))
    assert x.shape[0] >= max(quant_int4.NATIVE_DENSE_MIN_ROWS, quant_int8.NATIVE_DENSE_MIN_ROWS)
    assert torch.equal(forward(x, packed), run(x, packed))
    ref = packed_linear_reference(x, packed)
    torch.testing.assert_close(forward(x, packed), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_amx
def test_amx_kernel_on_gguf_blocks_and_zero_rows():
    from tests.kernels.test_native_linear import q4_1_tensor
    qt = q4_1_tensor(32, 256, seed=5)
    packed = quant_int4.pack(qt, None, CPU, layout="q4_1x")
    x = torch.zeros(3, 256)
    x[1, :32] = 1.0  # one all-zero group beside a non-zero one; rows 0 and 2 all zero
    torch.testing.assert_close(quant_int4.int4_linear_native(x, packed), packed_linear_reference(x, packed),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(quant_int4.int4_linear_native(x, packed)[0], torch.zeros(32))


@needs_amx
@pytest.mark.parametrize("layout,n,k", [("q4_1x", 48, 96), ("q4_1x", 96, 1536), ("q4_kx", 48, 512),
                                        ("q6_kx", 48, 512)])
def test_amx_rows_are_bit_equal_whatever_batch_and_threads(layout, n, k):
    """Batch invariance: a row's output does not depend on the rows beside it, on where it falls
    in the 8-row tiles, or on the thread count (each block of outputs is one thread's)."""
    gen = torch.Generator().manual_seed(k)
    packed, _, run = _tiles_and_plain(layout, n, k, seed=3, bias=torch.randn(n, generator=gen))
    rows = torch.randn(17, k, generator=gen) * 2
    alone = [run(rows[i:i + 1], packed)[0] for i in range(17)]
    for threads in (1, 2, 4):
        native.set_threads(threads)
        for batch in (3, 8, 9, 17):
            for start in (0, 17 - batch):
                y = run(rows[start:start + batch], packed)
                for i in range(batch):
                    assert torch.equal(y[i], alone[start + i]), (threads, batch, start, i)


@needs_amx
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_model_in_tiles_decodes_the_same_bits_natively_and_in_the_loop(tmp_path, monkeypatch, batch):
    from tests.engine.test_native_decode import assert_same_bits, both_ways, build

    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "q4_1x")
    model = build(tmp_path)
    assert model.layers[0].gate_up.layout == "q4_1x"
    assert_same_bits(*both_ways(model, batch))


@needs_amx
def test_a_q4_k_m_mix_in_tiles_decodes_the_same_bits(tmp_path, monkeypatch):
    """Q4_K matrices in "q4_kx" beside Q6_K ones in "q6_k" or "q6_kx" (a q|k|v stack of
    kernels), bf16 KV."""
    from tests.engine.test_native_decode import assert_same_bits, both_ways, build

    monkeypatch.setattr(quant_int4, "default_layout", lambda device: "q4_1x")
    for q6_layout in ("q6_k", "q6_kx"):  # the Q6_K matrices in either layout beside the tiles
        monkeypatch.setattr(quant_q6_k, "default_layout", lambda n, lay=q6_layout: lay)
        model = build(tmp_path, "int4", "Q4_K", types={"attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"})
        assert model.layers[0].gate_up.layout == "q4_kx" and model.layers[0].qkv.fmt == "stack"
        assert model.layers[0].qkv.parts[-1].layout == q6_layout
        assert model.layers[1].down.layout == q6_layout
        assert_same_bits(*both_ways(model, 3, kv_dtype=torch.bfloat16))


@needs_amx
def test_a_child_process_that_was_never_granted_tiles_asks_for_them(tmp_path):
    """The grant is per process: a fresh interpreter's first tile call asks the OS itself."""
    import subprocess
    import sys
    code = ("import torch; from kernels import quant_int4; "
            "p = quant_int4.pack(torch.randn(32, 64), None, torch.device('cpu'), layout='q4_1x'); "
            "print(float(quant_int4.int4_linear_native(torch.ones(1, 64), p).abs().sum()) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
