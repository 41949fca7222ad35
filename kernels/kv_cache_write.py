"""Write new K/V into the paged cache by slot.

Slot arithmetic: slot = block_id * block_size + offset_in_block. The cache for one layer is
k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], so viewing it as
[num_blocks * block_size, num_kv_heads, head_dim] makes the slot a row index. A negative slot
marks a token whose K/V is not stored (padding) and is skipped.
"""

from __future__ import annotations

import torch


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


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D] (contiguous); slot_mapping: [T] int64."""
    write_kv_cache_cpu(k, v, k_cache, v_cache, slot_mapping)
