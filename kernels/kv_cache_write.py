"""Write new K/V into the paged cache by slot.

Slot arithmetic: slot = block_id * block_size + offset_in_block. The cache for one layer is
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], so viewing it as
[num_blocks * block_size, num_kv_heads, head_dim] makes the slot a row index. A negative slot
marks a token whose K/V is not stored (padding) and is skipped.

    slot 37, block_size 16  ->  block 2, offset 5  ->  k_cache[2, 5] = k[t]

Three implementations: the reference (a Python loop, the definition), the CPU path (one
index_copy_ per cache) and a Triton kernel (one program per token) used on CUDA.
"""

import torch

from kernels._triton import HAS_TRITON, record_launch, triton, tl, use_triton


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, k_cache.shape[1])
        k_cache[b, o] = k[t]
        v_cache[b, o] = v[t]


def write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping) -> None:
    nb, bs, h, d = k_cache.shape
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


if HAS_TRITON:

    @triton.jit
    def _write_kv_cache_kernel(
        k_ptr,             # [T, Hkv, D]
        v_ptr,             # [T, Hkv, D]
        k_cache_ptr,       # [NB, BS, Hkv, D]
        v_cache_ptr,       # [NB, BS, Hkv, D]
        slot_ptr,          # [T] int32/int64, < 0 = skip
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cb, stride_cs, stride_ch, stride_cd,   # shared by k_cache and v_cache
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,    # tokens per cache block
        BLOCK_H: tl.constexpr,       # next_pow2(NUM_KV_HEADS)
        BLOCK_D: tl.constexpr,       # next_pow2(HEAD_DIM)
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        # int64 throughout: block * stride_cb passes 2**31 elements in a large cache.
        dst = (block * stride_cb + offset * stride_cs
               + h[:, None] * stride_ch + d[None, :] * stride_cd)
        k = tl.load(k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                    mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Launch the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("write_kv_cache_triton needs triton installed")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k, v must be [T, Hkv, D] of one shape, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache, v_cache must be [NB, BS, Hkv, D] with equal shapes and strides, "
                         f"got {tuple(k_cache.shape)}/{k_cache.stride()}, "
                         f"{tuple(v_cache.shape)}/{v_cache.stride()}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k is [T, {num_kv_heads}, {head_dim}] but the cache holds "
                         f"[*, *, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{num_tokens}] int32/int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if not (k.device == v.device == k_cache.device == v_cache.device == slot_mapping.device):
        raise ValueError("k, v, k_cache, v_cache and slot_mapping must share one device")
    if num_tokens == 0:
        return
    record_launch("kv_cache_write")
    _write_kv_cache_kernel[(num_tokens,)](
        k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_ptr=slot_mapping,
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_kd=k.stride(2),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_vd=v.stride(2),
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2), stride_cd=k_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T] int64 (int32
    also on the Triton path); a negative slot is skipped."""
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping)
