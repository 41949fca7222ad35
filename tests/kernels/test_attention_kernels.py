"""Paged attention: the Triton kernels (under TRITON_INTERPRET=1, fp32 and fp16), the CPU fast
paths (fp32, bf16; fp32 decodes run the native kernel, bf16 q the torch fallback) and the
dispatcher, each against paged_attention_reference. The native decode kernel at every native
level, and its torch fallback, are tested in detail in tests/kernels/test_native_attention.py.

Batches are ragged (q_len 1 .. tails that are no multiple of the tile), prefixes cross block
boundaries, blocks are handed out in shuffled order, and table entries past a sequence's last
block hold a huge id, so any read of them fails loudly. Large indexes: a sparse memory-mapped
cache of 2**31 + elements (a few pages of it touched) puts the used blocks past the int32
range, so offsets computed in int32 would read the wrong memory (in a child process).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.attention import (paged_attention, paged_attention_cpu, paged_attention_reference,
                               paged_attention_triton)

import triton  # noqa: E402,F401 - a test dependency: its interpreter runs the kernels here

from kernels.flash_attention import flash_attention_triton  # noqa: E402
from kernels.paged_attention import choose_num_splits, paged_decode_triton  # noqa: E402

UNUSED_BLOCK = 2**30            # table entries past a sequence's blocks: never to be read


def make_batch(q_lens, seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
               dtype=torch.float32, seed=0, k_cache=None, v_cache=None, first_block=0):
    """q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables for a ragged batch. Blocks
    come from [first_block, first_block + needed + 3) in shuffled order; the table is a
    column slice of a wider one (row stride != width)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    pool = first_block + torch.randperm(sum(need) + 3, generator=g)
    wide = torch.full((len(seq_lens), max(need) + 2), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        wide[b, :n] = pool[used:used + n].to(torch.int32)
        used += n
    tables = wide[:, :max(need) + 1]
    num_blocks = first_block + sum(need) + 3
    if k_cache is None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=g).to(dtype)
        v_cache = torch.randn(shape, generator=g).to(dtype)
    else:                          # a big preallocated cache: fill only the blocks in use
        for cache in (k_cache, v_cache):
            for block in pool.tolist():
                cache[block] = torch.randn(cache.shape[1:], generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


def check(out, args, scale, atol):
    ref = paged_attention_reference(*args, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


# Prefill chunks: fresh (q_len == seq_len), after a prefix ending mid-block and on a block
# boundary, a decode, and a 1-token fresh prefill; q tails of 1..15 past the 16-row tiles.
PREFILL_Q = [37, 5, 1, 1, 16, 23]
PREFILL_S = [37, 52, 9, 1, 48, 23 + 17]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_dim):
    args = make_batch(PREFILL_Q, PREFILL_S, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size)
    out = flash_attention_triton(*args, head_dim ** -0.5, block_m=16, block_n=16)
    check(out, args, head_dim ** -0.5, atol=1e-4)


def test_flash_kernel_block_size_one_and_wide_tiles():
    args = make_batch([9, 1, 20], [30, 7, 20], num_heads=3, num_kv_heads=1, block_size=1)
    out = flash_attention_triton(*args, 0.125, block_m=32, block_n=32)
    check(out, args, 0.125, atol=1e-4)


def test_flash_kernel_default_tiles_non_pow2_head_dim_and_strided_q():
    # head_dim 80 pads to 128 lanes; q is a slice, so its token stride is not Hq * D.
    q, *rest = make_batch([70, 3], [100, 3], num_heads=6, num_kv_heads=2, head_dim=80)
    q = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :80]
    out = flash_attention_triton(q, *rest, 80 ** -0.5)
    check(out, (q, *rest), 80 ** -0.5, atol=1e-4)


def test_flash_kernel_fp16():
    args = make_batch(PREFILL_Q, PREFILL_S, num_heads=6, num_kv_heads=2, dtype=torch.float16)
    out = flash_attention_triton(*args, 0.125, block_m=16, block_n=32)
    assert out.dtype == torch.float16
    check(out, args, 0.125, atol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_decode_kernel_matches_reference(num_splits, block_size, num_heads, num_kv_heads):
    # Contexts: 1, inside one block, on a boundary, across several blocks; with 3 splits the
    # short ones leave empty splits.
    lens = [1, 7, 32, 45, 100]
    args = make_batch([1] * len(lens), lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      block_size=block_size)
    out = paged_decode_triton(*args, 0.125, num_splits=num_splits, block_n=16)
    check(out, args, 0.125, atol=1e-4)


def test_decode_kernel_head_dim_128_fp16_default_blocks():
    lens = [130, 3, 64]
    args = make_batch([1] * 3, lens, num_heads=8, num_kv_heads=2, head_dim=128,
                      dtype=torch.float16)
    out = paged_decode_triton(*args, 128 ** -0.5, num_splits=2)
    check(out, args, 128 ** -0.5, atol=2e-2)


def test_decode_kernel_is_exact_for_any_q_len():
    # T == B routes to the decode kernel by shape alone: a 0-token plus a 2-token sequence
    # must still come out right, as must chunks after a prefix, with a split context.
    args = make_batch([0, 2, 1, 1], [5, 20, 9, 40])
    check(paged_attention_triton(*args, 0.125), args, 0.125, atol=1e-4)
    args = make_batch([3, 1, 5], [3, 30, 41])
    check(paged_decode_triton(*args, 0.125, num_splits=2, block_n=16), args, 0.125, atol=1e-4)


MIXED_Q = [1, 19, 1, 1, 33, 1, 4]             # decodes and prefill chunks interleaved
MIXED_S = [40, 19, 1, 77, 50, 16, 21]


def test_triton_dispatch_mixed_and_decode_only_batches():
    args = make_batch(MIXED_Q, MIXED_S, num_heads=6, num_kv_heads=2)
    check(paged_attention_triton(*args, 0.125), args, 0.125, atol=1e-4)
    args = make_batch([1] * 4, [3, 64, 17, 200], num_heads=6, num_kv_heads=2)
    check(paged_attention_triton(*args, 0.125), args, 0.125, atol=1e-4)


def sparse_cache(path, num_blocks, block_size, num_kv_heads, head_dim) -> torch.Tensor:
    """A float32 cache mapped from a sparse file: address space without memory."""
    numel = num_blocks * block_size * num_kv_heads * head_dim
    with open(path, "wb") as f:
        f.truncate(numel * 4)
    flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
    return flat.view(num_blocks, block_size, num_kv_heads, head_dim)


def large_index_case(tmp_dir: str) -> None:
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 16      # 8 GiB each
    k_cache, v_cache = (sparse_cache(Path(tmp_dir) / f"{name}.bin", num_blocks, block_size,
                                     num_kv_heads, head_dim) for name in "kv")
    first = num_blocks - 14
    assert first * block_size * num_kv_heads * head_dim > 2**31
    args = make_batch([1, 12, 1], [20, 30, 9], num_heads=2, num_kv_heads=1, head_dim=head_dim,
                      k_cache=k_cache, v_cache=v_cache, first_block=first)
    check(flash_attention_triton(*args, 0.125, block_m=16, block_n=16), args, 0.125, atol=1e-4)
    check(paged_decode_triton(*args, 0.125, num_splits=2, block_n=16), args, 0.125, atol=1e-4)


def test_large_block_ids_use_int64_offsets(tmp_path):
    """Blocks past element 2**31 of a sparse memory-mapped cache: int32 offsets would wrap.
    Runs in a child process, because a wrapped offset is an unmapped address, and that
    crash must fail this test rather than end the whole run."""
    child = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]


def test_choose_num_splits():
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=512, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_context=4096, num_sms=132) == 8
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_context=65536, num_sms=132) == 16


def test_launchers_reject_bad_arguments():
    q, k_cache, v_cache, cu, lens, tables = make_batch([3, 1], [3, 9])
    with pytest.raises(ValueError, match="int32"):
        flash_attention_triton(q, k_cache, v_cache, cu.long(), lens, tables, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_triton(q[:, :3], k_cache, v_cache, cu, lens, tables, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention_triton(q[..., :32], k_cache, v_cache, cu, lens, tables, 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(q.half(), k_cache, v_cache, cu, lens, tables, 0.1)
    with pytest.raises(ValueError, match="block_m"):
        flash_attention_triton(q, k_cache, v_cache, cu, lens, tables, 0.1, block_m=24)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_triton(q, k_cache, v_cache, cu, lens, tables[:1], 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_triton(q, k_cache, v_cache, cu, lens, tables, 0.1, num_splits=0)


# CPU fast paths, through the dispatcher (q on the CPU -> paged_attention_cpu).

@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_cpu_dispatcher_matches_reference(dtype, atol, block_size, num_heads, num_kv_heads):
    # Mixed batch plus two sequences sharing (q_len, seq_len), which share one SDPA call.
    q_lens, seq_lens = MIXED_Q + [6, 6, 0], MIXED_S + [6, 6, 4]
    args = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      block_size=block_size, dtype=dtype)
    out = paged_attention(*args, 0.125)
    assert out.dtype == dtype and out.shape == args[0].shape
    check(out, args, 0.125, atol=atol)


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_decode_only_and_prefill_only_batches(head_dim, native_on, monkeypatch):
    # Decodes: the native kernel, and the torch gather path where the library is unavailable
    # (tests/kernels/test_native_attention.py covers both, per native level, in detail).
    if not native_on:
        monkeypatch.setattr(native, "available", lambda: False)
    for q_lens, seq_lens in (([1] * 5, [1, 15, 16, 17, 300]), ([50, 8, 8], [50, 8, 90])):
        args = make_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=head_dim)
        check(paged_attention_cpu(*args, head_dim ** -0.5), args, head_dim ** -0.5, atol=1e-5)


if __name__ == "__main__":              # the child of test_large_block_ids_use_int64_offsets
    torch.set_num_threads(1)
    large_index_case(sys.argv[1])


def test_cpu_mixed_batch_over_a_bf16_cache_with_fp32_queries():
    """The model's bf16 KV cache: fp32 queries, bf16 K/V; decodes and prefill chunks in one
    batch equal the reference on the same cache values upcast."""
    q, k_cache, v_cache, cu, lens, tables = make_batch(PREFILL_Q, PREFILL_S, num_heads=6,
                                                       num_kv_heads=2, dtype=torch.float32)
    k16, v16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    out = paged_attention(q, k16, v16, cu, lens, tables, 0.125)
    ref = paged_attention_reference(q, k16.float(), v16.float(), cu, lens, tables, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
