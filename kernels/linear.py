"""Linear layers in several weight formats, behind one `pack_linear` / `linear` pair.

The model packs each projection once at load time into a `PackedLinear` for the chosen
format, then calls `linear(x, packed)` in the forward pass. Activations come in and go out in
the caller's dtype (fp32 residual stream); each format casts to what its kernel needs.

Formats: "fp32", "bf16" (dense). Quantized formats ("int8", "int4", "w8a8") register here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quantized_tensor import QuantizedTensor


def to_float(w: torch.Tensor | QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w.dequantize() if isinstance(w, QuantizedTensor) else w).to(dtype)


@dataclass
class PackedLinear:
    fmt: str
    in_features: int
    out_features: int
    weight: torch.Tensor  # format-specific packed payload
    bias: torch.Tensor | None = None  # fp32 [out]
    scales: torch.Tensor | None = None  # format-specific (per-channel or per-group)
    zeros: torch.Tensor | None = None


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_linear(weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, fmt: str) -> PackedLinear:
    out_features, in_features = weight.shape
    bias = None if bias is None else bias.float().contiguous()
    if fmt == "fp32":
        return PackedLinear(fmt, in_features, out_features, to_float(weight).contiguous(), bias)
    if fmt == "bf16":
        return PackedLinear(fmt, in_features, out_features, to_float(weight, torch.bfloat16).contiguous(), bias)
    raise ValueError(f"unknown linear weight format {fmt!r}")


def linear(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x: [T, in] -> [T, out] in x's dtype."""
    if packed.fmt in ("fp32", "bf16"):
        y = torch.nn.functional.linear(x.to(packed.weight.dtype), packed.weight)
        y = y.to(x.dtype)
        return y if packed.bias is None else y + packed.bias
    raise ValueError(f"unknown linear weight format {packed.fmt!r}")
