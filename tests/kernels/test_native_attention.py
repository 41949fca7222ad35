"""CPU decode attention: the native kernel (kernels/csrc/paged_decode.cpp, through
kernels/paged_attention.py's paged_decode_native) at every native level this host runs, and the
torch fallback (paged_decode_torch), each against paged_attention_reference.

Cases: fp32 and bf16 caches with fp32 q (the model's residual stream is fp32; a bf16 cache is
compared against the reference on the same bf16 values, upcast), GQA ratios 1, 3 and 4, head_dim
64 and dims that leave a scalar tail past the vector width (24, 20), ragged lengths across block
boundaries, block ids scattered over a larger cache (table entries past a sequence's need hold a
huge id, so reading one fails loudly), strided q / out / cache views, batches of 1 and 8, and a
mixed batch through paged_attention where decodes and a prefill chunk write into one output.
"""

import dataclasses

import pytest
import torch

import kernels.paged_attention as pa
from kernels import native
from kernels.attention import paged_attention, paged_attention_reference, plan_paged_attention

UNUSED_BLOCK = 2**30            # table entries past a sequence's blocks: never to be read


def host_levels() -> list[str]:
    """The native levels this host can run: every level up to the dispatch level."""
    return list(native.LEVELS[:native.LEVELS.index(native.dispatch_level()) + 1])


@pytest.fixture(params=host_levels())
def level(request):
    # The native kernels are part of the product (.ci/run installs g++): a level that does not
    # build fails here rather than being skipped.
    native.library(request.param)
    return request.param


def make_batch(q_lens, seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
               cache_dtype=torch.float32, seed=0):
    """q (fp32), k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables. The blocks in use are
    scattered over a cache three times larger than needed, in shuffled order; the table is a
    column slice of a wider one (row stride != width)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 3 * sum(need) + 2
    pool = torch.randperm(num_blocks, generator=g)[:sum(need)]
    wide = torch.full((len(seq_lens), max(need) + 3), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        wide[b, :n] = pool[used:used + n].to(torch.int32)
        used += n
    tables = wide[:, :max(need) + 1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


def decode_plan(args):
    _, k_cache, _, cu, lens, tables = args
    return plan_paged_attention(cu, lens, tables, k_cache.shape[1]).decode


def check(out, args, scale, tol=1e-5):
    ref = paged_attention_reference(*args, scale)       # upcasts a bf16 cache to fp32 itself
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


LENS = {1: [100], 8: [1, 15, 16, 17, 100, 33, 2, 64]}       # ragged, across block boundaries
GQA = [(2, 2), (6, 2), (4, 1)]                             # Hq / Hkv = 1, 3, 4


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 24, 20])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_matches_reference(level, cache_dtype, num_heads, num_kv_heads, head_dim,
                                         batch):
    lens = LENS[batch]
    args = make_batch([1] * batch, lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, cache_dtype=cache_dtype)
    q, k_cache, v_cache = args[:3]
    assert k_cache.dtype == cache_dtype and q.dtype == torch.float32
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_native(q, k_cache, v_cache, decode_plan(args), head_dim ** -0.5, out, level)
    check(out, args, head_dim ** -0.5)


def test_native_decode_single_token_and_block_size_one(level):
    for block_size, lens in ((16, [1]), (1, [1, 5, 30])):
        args = make_batch([1] * len(lens), lens, num_heads=6, num_kv_heads=2,
                          block_size=block_size)
        out = torch.full_like(args[0], float("nan"))
        pa.paged_decode_native(*args[:3], decode_plan(args), 0.125, out, level)
        check(out, args, 0.125)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_strided_q_out_and_cache(level, cache_dtype):
    """q and out with a row stride != Hq * D; K and V interleaved per block in one
    [NB, 2, BS, Hkv, D] tensor (block stride 2 * BS * Hkv * D); and the model's layout,
    kv_cache[i, 0] / kv_cache[i, 1] of a [L, 2, NB, BS, Hkv, D] cache."""
    args = make_batch([1] * 8, LENS[8], num_heads=6, num_kv_heads=2, cache_dtype=cache_dtype)
    q, k_cache, v_cache, *index = args
    plan = decode_plan(args)
    wide_q = torch.cat([q, torch.randn_like(q)], dim=1)[:, :6]
    assert wide_q.stride(0) == 12 * 64 and torch.equal(wide_q, q)
    wide_out = torch.full((q.shape[0], 9, 64), float("nan"))
    out = wide_out[:, 1:7]
    interleaved = torch.stack([k_cache, v_cache], dim=1)                   # [NB, 2, BS, Hkv, D]
    pa.paged_decode_native(wide_q, interleaved[:, 0], interleaved[:, 1], plan, 0.125, out, level)
    check(out, args, 0.125)
    assert wide_out[:, [0, 7, 8]].isnan().all()                          # nothing else written

    layer = torch.stack([k_cache, v_cache])                                # [2, NB, BS, Hkv, D]
    model_cache = torch.stack([torch.zeros_like(layer), layer, torch.zeros_like(layer)])
    k_layer, v_layer = model_cache[1, 0], model_cache[1, 1]                # of [L=3, 2, NB, ...]
    assert k_layer.shape == k_cache.shape and k_layer.stride() == (16 * 2 * 64, 2 * 64, 64, 1)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_native(q, k_layer, v_layer, plan, 0.125, out, level)
    check(out, args, 0.125)


def test_native_decode_rejects_what_it_cannot_read():
    args = make_batch([1, 1], [20, 9], num_heads=4, num_kv_heads=2)
    q, k_cache, v_cache, *_ = args
    plan = decode_plan(args)
    out = torch.empty_like(q)
    head_major = k_cache.transpose(1, 2).contiguous().transpose(1, 2)       # stride(2) != D
    assert not pa.native_decode_supported(q, head_major, head_major, out)
    assert not pa.native_decode_supported(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                                          out.bfloat16())
    assert not pa.native_decode_supported(q, k_cache.half(), v_cache.half(), out)
    assert pa.native_decode_supported(q, k_cache, v_cache, out)
    with pytest.raises(ValueError, match="unsupported"):
        pa.paged_decode_native(q, head_major, head_major, plan, 0.125, out)
    # paged_decode_cpu falls back to the torch path for such a cache, with the same result.
    pa.paged_decode_cpu(q, head_major, v_cache, plan, 0.125, out)
    check(out, args, 0.125)


def test_native_decode_return_code_is_checked():
    args = make_batch([1, 1], [20, 9])
    plan = decode_plan(args)
    bad = dataclasses.replace(plan, lens32=torch.tensor([20, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="paged decode"):
        pa.paged_decode_native(*args[:3], bad, 0.125, torch.empty_like(args[0]))


def test_native_decode_refuses_a_plan_outside_its_tensors():
    """The kernel reads what it is told to: a plan for another cache or batch must not reach it."""
    args = make_batch([1, 1], [20, 9])
    q, k_cache, v_cache, *_ = args
    plan = decode_plan(args)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="out of range"):
        pa.paged_decode_native(q, k_cache[:plan.max_block], v_cache[:plan.max_block], plan,
                               0.125, out)
    with pytest.raises(ValueError, match="out of range"):
        pa.paged_decode_native(q[:1], k_cache, v_cache, plan, 0.125, out[:1])
    with pytest.raises(ValueError, match="out of range"):             # block size 8, not 16
        pa.paged_decode_native(q, k_cache.view(-1, 8, *k_cache.shape[2:]),
                               v_cache.view(-1, 8, *v_cache.shape[2:]), plan, 0.125, out)


def test_plan_holds_the_native_index_tensors():
    args = make_batch([1, 7, 1], [40, 7, 3], block_size=16)
    tables = args[5]
    plan = decode_plan(args)
    assert plan.rows32.tolist() == [0, 8] and plan.lens32.tolist() == [40, 3]
    assert plan.rows32.dtype == plan.lens32.dtype == plan.table32.dtype == torch.int32
    assert plan.table32.shape == (2, 3) and plan.table32.is_contiguous()
    assert plan.table32[0].tolist() == tables[0, :3].tolist()
    assert plan.table32[1].tolist() == [tables[2, 0].item(), 0, 0]         # past need -> 0
    assert plan.tables.tolist() == plan.table32.reshape(-1).tolist()
    assert (plan.max_row, plan.max_block, plan.max_len) == (8, int(plan.table32.max()), 40)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback_matches_reference(cache_dtype, num_heads, num_kv_heads, batch):
    args = make_batch([1] * batch, LENS[batch], num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=24, cache_dtype=cache_dtype)
    out = torch.full_like(args[0], float("nan"))
    pa.paged_decode_cpu(*args[:3], decode_plan(args), 24 ** -0.5, out, use_native=False)
    check(out, args, 24 ** -0.5)


@pytest.mark.parametrize("native_on", [True, False])
def test_mixed_batch_through_paged_attention(monkeypatch, native_on):
    """Decodes (native, or the torch fallback where the library is unavailable) and a prefill
    chunk (SDPA) write into one output, with and without a per-pass plan."""
    calls = []
    real = pa.paged_decode_native
    monkeypatch.setattr(pa, "paged_decode_native", lambda *a, **k: calls.append(a) or real(*a, **k))
    if not native_on:
        monkeypatch.setattr(native, "available", lambda: False)
    q_lens, seq_lens = [1, 19, 1, 1, 33, 1], [40, 19, 1, 77, 50, 16]
    args = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2)
    check(paged_attention(*args, 0.125), args, 0.125)
    plan = plan_paged_attention(*args[3:], args[1].shape[1])
    check(paged_attention(*args, 0.125, plan), args, 0.125)
    assert len(calls) == (2 if native_on else 0)
