"""KV-cache write by slot: the Triton kernel (under TRITON_INTERPRET=1) and the CPU path against
the reference loop. Whole caches are compared, so a skipped (negative) slot that was written,
or a neighbour row that was touched, fails."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.kv_cache_write import write_kv_cache, write_kv_cache_cpu, write_kv_cache_reference

import triton  # noqa: E402,F401 - a test dependency: its interpreter runs the kernels here

from kernels.kv_cache_write import write_kv_cache_triton  # noqa: E402


def make_case(num_tokens, num_kv_heads, head_dim, block_size=16,
              dtype=torch.float32, cache_dtype=torch.float32, slot_dtype=torch.int64, seed=0):
    """k, v as strided slices of one fused projection output; slots unique, every third -1;
    the caches are views inside guarded buffers (compare `cache._base`)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-2 * num_tokens // block_size)           # room for twice the tokens
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g).to(dtype)
    k, v = fused[:, num_kv_heads:2 * num_kv_heads], fused[:, 2 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1
    # One guard block on each side: a write through a negative slot lands there and shows up
    # in the comparison, instead of corrupting memory outside the tensor.
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_full = torch.randn(shape, generator=g).to(cache_dtype)
    v_full = torch.randn(shape, generator=g).to(cache_dtype)
    return k, v, k_full[1:-1], v_full[1:-1], slots.to(slot_dtype)


def expected(k, v, k_cache, v_cache, slots):
    """The guarded buffers after the reference write."""
    k_ref, v_ref = k_cache._base.clone(), v_cache._base.clone()
    write_kv_cache_reference(k, v, k_ref[1:-1], v_ref[1:-1], slots.long())
    return k_ref, v_ref


def assert_written(k_cache, v_cache, k_ref, v_ref):
    assert torch.equal(k_cache._base, k_ref) and torch.equal(v_cache._base, v_ref)


@pytest.mark.parametrize("writer", [write_kv_cache_triton, write_kv_cache_cpu, write_kv_cache])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80), (1, 128)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_write_matches_reference(writer, num_kv_heads, head_dim, block_size):
    k, v, k_cache, v_cache, slots = make_case(13, num_kv_heads, head_dim, block_size)
    k_ref, v_ref = expected(k, v, k_cache, v_cache, slots)
    writer(k, v, k_cache, v_cache, slots)
    assert_written(k_cache, v_cache, k_ref, v_ref)


@pytest.mark.parametrize("writer", [write_kv_cache_triton, write_kv_cache_cpu])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float16),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16)])
def test_write_converts_to_cache_dtype(writer, dtype, cache_dtype):
    k, v, k_cache, v_cache, slots = make_case(9, 2, 64, dtype=dtype, cache_dtype=cache_dtype)
    k_ref, v_ref = expected(k, v, k_cache, v_cache, slots)
    writer(k, v, k_cache, v_cache, slots)
    assert_written(k_cache, v_cache, k_ref, v_ref)


def test_triton_all_slots_skipped_and_int32_slots():
    k, v, k_cache, v_cache, slots = make_case(5, 2, 64)
    before = k_cache._base.clone(), v_cache._base.clone()
    write_kv_cache_triton(k, v, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int64))
    assert_written(k_cache, v_cache, *before)
    k_ref, v_ref = expected(k, v, k_cache, v_cache, slots)
    write_kv_cache_triton(k, v, k_cache, v_cache, slots.int())
    assert_written(k_cache, v_cache, k_ref, v_ref)


def test_triton_rejects_bad_arguments():
    k, v, k_cache, v_cache, slots = make_case(5, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(k, v, k_cache, v_cache, slots[:4])
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(k, v, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="cache holds"):
        write_kv_cache_triton(k[:, :1], v[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k, v"):
        write_kv_cache_triton(k, v[:4], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k_cache, v_cache"):
        write_kv_cache_triton(k, v, k_cache, v_cache[..., :32], slots)


def large_slot_case(tmp_dir: str) -> None:
    """int32 slots whose row offset (slot * Hkv * D) passes 2**31 elements, into sparse
    memory-mapped caches: 8 GiB of address space each, a few pages touched."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 4
    numel = num_blocks * block_size * num_kv_heads * head_dim
    caches = []
    for name in "kv":
        path = Path(tmp_dir) / f"{name}.bin"
        with open(path, "wb") as f:
            f.truncate(numel * 4)
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.float32)
        caches.append(flat.view(num_blocks, block_size, num_kv_heads, head_dim))
    k = torch.randn(4, num_kv_heads, head_dim)
    v = torch.randn(4, num_kv_heads, head_dim)
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, -1, 7, (num_blocks - 3) * block_size],
                         dtype=torch.int32)
    assert int(slots.max()) * num_kv_heads * head_dim > 2**31
    write_kv_cache_triton(k, v, caches[0], caches[1], slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(caches[0][block, offset], k[t])
            assert torch.equal(caches[1][block, offset], v[t])
    assert not caches[0][num_blocks - 2].any()        # untouched (zero pages of the file)


def test_triton_large_slots_use_int64_offsets(tmp_path):
    """Runs in a child process: a wrapped int32 offset is an unmapped address, and that crash
    must fail this test rather than end the whole run."""
    child = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]


if __name__ == "__main__":              # the child of test_triton_large_slots_use_int64_offsets
    torch.set_num_threads(1)
    large_slot_case(sys.argv[1])
