"""RoPE cos/sin tables, with the frequency scaling a model asks for.

Tables are fp32 [max_position, head_dim // 2], computed once per model, as Hugging Face does
(inv_freq in fp32, outer product with fp32 positions), so logits match the reference.
"""

from __future__ import annotations

import math

import torch

from common.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama-3.1's rope_type "llama3").
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_position: int, theta: float,
                scaling: RopeScaling | None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return freqs.cos().contiguous(), freqs.sin().contiguous()
