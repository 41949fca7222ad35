"""The attention prologue of a layer: split the fused qkv projection, rotate q and k (RoPE),
write k and v into the paged KV cache; returns q.

    qkv           [T, (Hq + 2 Hkv) * D]   the fused projection's output (q heads, k heads, v heads)
    positions     [T] int64               position of each token (indexes cos/sin)
    cos, sin      [max_position, D / 2]   fp32 tables (kernels/rotary.py has the convention)
    k/v_cache     [NB, BS, Hkv, D]        fp32 or bf16; token t goes to slot slot_mapping[t]
    slot_mapping  [T] int64               NB * BS slots; negative = not written
    -> q          [T, Hq, D]

CPU with the native kernels and fp32 qkv: one fused pass (kernels/csrc/rotary_kv_write.cpp),
which replaced some 25 small torch ops per layer of a decode step. Elsewhere (CUDA, or no
native build): the separate ops kernels/rotary.py and kernels/kv_cache_write.py, each of which
has its own Triton kernel. `rotary_kv_write_reference` composes their references: the
definition.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels._triton import use_triton
from kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from kernels.rotary import apply_rotary, apply_rotary_reference


def _split(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
            v.reshape(t, num_kv_heads, head_dim))


def rotary_kv_write_reference(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                              num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    q, k, v = _split(qkv, num_heads, num_kv_heads, head_dim)
    q, k = apply_rotary_reference(q, k, positions, cos, sin)
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping)
    return q


def native_supported(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> bool:
    nb, bs, hkv, d = k_cache.shape
    return (native.available() and not qkv.is_cuda and not use_triton(qkv) and qkv.dtype == torch.float32
            and qkv.stride(1) == 1 and cos.dtype == torch.float32 and cos.is_contiguous()
            and k_cache.dtype in (torch.float32, torch.bfloat16) and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def rotary_kv_write_native(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                           num_heads: int, num_kv_heads: int, head_dim: int,
                           level: str | None = None) -> torch.Tensor:
    t = qkv.shape[0]
    if qkv.shape[1] < (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[1]} features, expected {(num_heads + 2 * num_kv_heads) * head_dim}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim) or cos.shape[1] * 2 != head_dim:
        raise ValueError(f"cache {tuple(k_cache.shape)} / rope table {tuple(cos.shape)} do not fit "
                         f"{num_kv_heads} kv heads of dim {head_dim}")
    positions = positions.contiguous()
    slot_mapping = slot_mapping.contiguous()
    q = torch.empty(t, num_heads, head_dim)
    native.check(native.library(level).tandem_rotary_kv_write(
        qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.contiguous().data_ptr(),
        cos.shape[0], t, num_heads, num_kv_heads, head_dim, q.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), k_cache.shape[0] * k_cache.shape[1],
        slot_mapping.data_ptr()), "rotary + kv write (position or slot out of range?)")
    return q


def rotary_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    if native_supported(qkv, cos, k_cache, v_cache):
        return rotary_kv_write_native(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                      num_heads, num_kv_heads, head_dim)
    q, k, v = _split(qkv, num_heads, num_kv_heads, head_dim)
    q, k = apply_rotary(q, k, positions, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    return q
