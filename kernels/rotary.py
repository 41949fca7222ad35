"""Rotary position embedding, rotate-half ("NeoX") convention as Hugging Face's Llama uses.

For head_dim D and half = D // 2, with c = cos[pos], s = sin[pos] (each [half]):
    out[:half] = x[:half] * c - x[half:] * s
    out[half:] = x[half:] * c + x[:half] * s
cos/sin tables are built once by the engine (they carry any RoPE scaling) in fp32.
The Triton kernel runs one program per token and rotates all of its q and k heads with one
read of cos/sin; table offsets are int64, so positions past 2^31 / half stay correct.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, record_launch, tl, triton, use_triton


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].float()[:, None, :]
    s = sin[positions].float()[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def apply_rotary_cpu(q, k, positions, cos, sin):
    return apply_rotary_reference(q, k, positions, cos, sin)


if HAS_TRITON:

    @triton.jit
    def _rotate_heads(
        src,  # [H, 2 * HALF] one token's heads, head stride stride_h, unit column stride
        dst,  # [H, 2 * HALF] contiguous
        n_heads, stride_h, c, s,  # c, s: [BLOCK_D] fp32, zero past HALF
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        d = tl.arange(0, BLOCK_D)
        for h0 in range(0, n_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
            src_lo = src + h[:, None] * stride_h + d[None, :]
            x1 = tl.load(src_lo, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src_lo + HALF, mask=mask, other=0.0).to(tl.float32)
            dst_lo = dst + h[:, None] * (2 * HALF) + d[None, :]
            tl.store(dst_lo, (x1 * c[None, :] - x2 * s[None, :]).to(dst.dtype.element_ty), mask=mask)
            tl.store(dst_lo + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr,  # [T, HQ, D], unit column stride
        k_ptr,  # [T, HKV, D], unit column stride
        qo_ptr,  # [T, HQ, D] out, contiguous
        ko_ptr,  # [T, HKV, D] out, contiguous
        pos_ptr,  # [T] int positions
        cos_ptr,  # [max_pos, HALF] fp32, row stride stride_cs
        sin_ptr,  # [max_pos, HALF] fp32, row stride stride_cs
        HQ, HKV, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        c = tl.load(cos_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * (HQ * 2 * HALF), HQ, stride_qh, c, s,
                      HALF, BLOCK_H, BLOCK_D)
        _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * (HKV * 2 * HALF), HKV, stride_kh, c, s,
                      HALF, BLOCK_H, BLOCK_D)


def apply_rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAS_TRITON:
        raise RuntimeError("apply_rotary_triton needs triton")
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    assert d % 2 == 0 and k.shape == (t, hkv, d) and positions.shape == (t,)
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos.shape[1] == half and sin.shape == cos.shape and cos.stride() == sin.stride() and cos.stride(1) == 1
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    block_d = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(hq, hkv)), max(1, 4096 // block_d))
    record_launch("rotary")
    _rotary_kernel[(t,)](
        q, k, q_out, k_out, positions, cos, sin,
        hq, hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return q_out, k_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T] int64; cos, sin: [max_pos, D/2] fp32."""
    if use_triton(q):
        return apply_rotary_triton(q, k, positions, cos, sin)
    return apply_rotary_cpu(q, k, positions, cos, sin)
