"""Rotary position embedding, rotate-half ("NeoX") convention as Hugging Face's Llama uses.

For head_dim D and half = D // 2, with c = cos[pos], s = sin[pos] (each [half]):
    out[:half] = x[:half] * c - x[half:] * s
    out[half:] = x[half:] * c + x[:half] * s
cos/sin tables are built once by the engine (they carry any RoPE scaling) in fp32.
"""

from __future__ import annotations

import torch


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


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T] int64; cos, sin: [max_pos, D/2] fp32."""
    return apply_rotary_cpu(q, k, positions, cos, sin)
