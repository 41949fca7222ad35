"""Batch-invariant mode's kernels (kernels/batch_invariance.py), bit for bit: a linear row's
result whatever rows share its call (counts on both sides of every dense switch point, the row
at many places in the tiles), and attention rows whatever chunk or decode they are computed in.
The model-level check is tests/engine/test_batch_invariance_engine.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import batch_invariance, quant_int4, quant_int8
from kernels.attention import paged_attention, paged_attention_reference
from kernels.linear import linear, pack_linear

FORMATS = ["fp32", "bf16", "int8", "int4", "int4a8", "w8a8"]
BATCHES = [1, 5, 16, 47, 48, 63, 64, 65, 130, 200]  # below and above every switch point


@pytest.fixture
def invariant():
    previous = batch_invariance.set_enabled(True)
    yield
    batch_invariance.set_enabled(previous)


def test_switch_points_are_inside_the_batches():
    top = max(BATCHES)
    for rows in (batch_invariance.DENSE_TILE_ROWS, quant_int4.NATIVE_DENSE_MIN_ROWS,
                 quant_int8.NATIVE_DENSE_MIN_ROWS, quant_int8.CPU_DENSE_MIN_ROWS):
        assert any(b < rows for b in BATCHES) and any(rows < b <= top for b in BATCHES)


@pytest.mark.parametrize("m", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_tiles_compute_the_product(m, dtype):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(96, 320, generator=gen).to(dtype)
    x = torch.randn(m, 320, generator=gen).to(dtype)
    y = batch_invariance.dense_linear(x, w)
    assert y.shape == (m, 96) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_rows_do_not_depend_on_their_batch(invariant, fmt):
    # The default model's q/gate shape: wide enough for the BLAS libraries' small-M paths.
    gen = torch.Generator().manual_seed(7)
    packed = pack_linear(torch.randn(1536, 576, generator=gen) * 0.05, torch.randn(1536, generator=gen),
                         fmt)
    x = torch.randn(max(BATCHES) + 40, 576, generator=gen)
    probes = [0, 3, 31, 64, 129]  # rows checked against their own single-row result
    alone = {i: linear(x[i:i + 1], packed)[0] for i in probes}
    for batch in BATCHES:
        for start in (0, 1, 37):
            y = linear(x[start:start + batch], packed)
            for i in probes:
                if start <= i < start + batch:
                    assert torch.equal(y[i - start], alone[i]), (fmt, batch, start, i)


def paged(seq_len: int, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=0):
    """One sequence's K/V over scattered blocks of a larger cache, and queries for every
    position."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size)
    k_cache = torch.randn(3 * num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(3 * num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    table = torch.randperm(3 * num_blocks, generator=gen)[:num_blocks].to(torch.int32)[None]
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, table


def attend(q, k_cache, v_cache, table, rows: list[tuple[int, int]], reference=False):
    """Query positions [lo, hi) of the sequence as one batch entry each (a chunk of hi - lo
    rows with hi tokens of context), all in one pass."""
    q_batch = torch.cat([q[lo:hi] for lo, hi in rows])
    cu = torch.tensor([0] + [hi - lo for lo, hi in rows]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([hi for _, hi in rows], dtype=torch.int32)
    tables = table.expand(len(rows), -1).contiguous()
    fn = paged_attention_reference if reference else paged_attention
    return fn(q_batch, k_cache, v_cache, cu, seq_lens, tables, 0.125)


@pytest.mark.parametrize("seq_len", [70, 300])
def test_attention_rows_do_not_depend_on_their_chunk(invariant, seq_len):
    q, k_cache, v_cache, table = paged(seq_len, seed=seq_len)
    whole = attend(q, k_cache, v_cache, table, [(0, seq_len)])
    torch.testing.assert_close(whole, attend(q, k_cache, v_cache, table, [(0, seq_len)], reference=True),
                               rtol=1e-5, atol=1e-5)
    cut = seq_len // 3
    chunked = torch.cat([attend(q, k_cache, v_cache, table, [(0, cut)]),
                         attend(q, k_cache, v_cache, table, [(cut, 2 * cut), (2 * cut, seq_len)])])
    assert torch.equal(chunked, whole)
    last = seq_len - 1  # the same position as a decode step, beside another sequence's chunk
    mixed = attend(q, k_cache, v_cache, table, [(5, 9), (last, seq_len)])
    assert torch.equal(mixed[4], whole[last])
    assert torch.equal(mixed[:4], whole[5:9])
