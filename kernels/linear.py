"""Linear layers in several weight formats, behind one `pack_linear` / `linear` pair.

The model packs each projection once at load time into a `PackedLinear` for the chosen
format, then calls `linear(x, packed)` in the forward pass. Activations come in and go out in
the caller's dtype (fp32 residual stream); each format casts to what its kernel needs.

Formats, and the phase each is for (DESIGN.md, "prefill is compute-bound, decode is bandwidth-bound"):

    fmt     weights                                   activations      module
    fp32    dense fp32                                as given         here
    bf16    dense bf16                                bf16             here
    int8    int8, per-output-channel symmetric        bf16 (weight-    kernels.quant_int8  (decode)
                                                      only)
    int4    4-bit, group 32, asymmetric (zero point); bf16 (weight-    kernels.quant_int4  (decode)
            GGUF Q4_0/Q4_1 repacked without floats    only)
    int4a8  int4's weights                            int8 per group   kernels.quant_int4  (decode)
                                                      of 32 (native
                                                      CPU kernel)
    w8a8    int8, per-output-channel symmetric,       int8 per token,  kernels.quant_w8a8  (prefill)
            optional SmoothQuant                      int32 accumulate

Quantized formats live one per module and register here by name; a module is imported only when
its format is first used (lazy registry). Each module provides:

    pack(weight, bias, device, **options) -> PackedLinear
    forward(x2d, packed) -> y2d                    x2d: [T, in] in any float dtype -> [T, out], same dtype
    dequantize(packed) -> fp32 [out, in]           the weights the kernels actually use
    reference(x2d, packed) -> y2d                  plain fp32 torch, the definition tests compare against

The packed payload depends on the device that will run it (`PackedLinear.layout`): CPU packs for
the aten CPU kernels, CUDA packs for the Triton kernels in the same module.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import batch_invariance
from kernels.quantized_tensor import QuantizedTensor

# fmt -> module implementing it. Dense formats are handled in this file.
_QUANTIZED_FORMATS = {
    "int8": "kernels.quant_int8",
    "int4": "kernels.quant_int4",
    "int4a8": "kernels.quant_int4",  # int4 weights, int8 activations per group (the module's docstring)
    "w8a8": "kernels.quant_w8a8",
}
DENSE_FORMATS = ("fp32", "bf16")
FORMATS = DENSE_FORMATS + tuple(_QUANTIZED_FORMATS)


def to_float(w: torch.Tensor | QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w.dequantize() if isinstance(w, QuantizedTensor) else w).to(dtype)


# Rows of a matrix converted to floats at a time while packing: ~16 MiB of fp32, so a pack's
# temporaries are a few such chunks however large the matrix is (an 8B model's gate|up,
# 28672 x 4096, is 470 MB in fp32; packed whole, its fp32 copy and the copies scaling and
# rounding made held ~1.4 GB at once).
CHUNK_ELEMENTS = 1 << 22


def float_row_chunks(w: torch.Tensor | QuantizedTensor, dtype: torch.dtype = torch.float32):
    """Yields (first row, rows in dtype) over w [out, in] in chunks of about CHUNK_ELEMENTS,
    for formats that pack each row on its own (each chunk equals to_float(w)[r0:r1] bit for
    bit: GGUF rows dequantize independently)."""
    rows, cols = w.shape
    step = max(1, CHUNK_ELEMENTS // max(1, cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = w.row_slice(r0, r1) if isinstance(w, QuantizedTensor) else w[r0:r1]
        yield r0, to_float(part, dtype)


@dataclass
class PackedLinear:
    fmt: str
    in_features: int
    out_features: int
    weight: torch.Tensor  # format-specific packed payload (may be padded past in/out_features)
    bias: torch.Tensor | None = None  # fp32 [out]
    scales: torch.Tensor | None = None  # format-specific (per-channel or per-group)
    zeros: torch.Tensor | None = None  # format-specific (int4: None, zeros travel with scales)
    layout: str = "dense"  # how `weight` is laid out; which kernel can read it (see the format module)
    group_size: int = 0  # int4: input features per scale/zero group
    act_scale: torch.Tensor | None = None  # w8a8 SmoothQuant: fp32 [in], x is multiplied by it first
    # A row stack (stack_linear, fmt STACK): each part computes its own rows of the output, in
    # order; the stack's own tensors are empty.
    parts: tuple[PackedLinear, ...] = ()


STACK = "stack"


def stack_linear(parts: list[PackedLinear]) -> PackedLinear:
    """One layer whose output rows are those of `parts` in turn (a fused q|k|v whose parts a GGUF
    stores in different types, e.g. Q4_K_M's Q4_K q and k beside a Q6_K v: each keeps the
    layout that reads its own blocks exactly, rather than all of them being requantized to one
    format). Each part is its own kernel call."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError(f"stacked parts must share in_features, got {[p.in_features for p in parts]}")
    return PackedLinear(STACK, parts[0].in_features, sum(p.out_features for p in parts), torch.empty(0),
                        layout=STACK, parts=tuple(parts))


def packed_nbytes(p: PackedLinear) -> int:
    """Bytes a pass reads for the layer: its payload, scales, zeros, bias and activation scale."""
    return sum(t.numel() * t.element_size() for t in (p.weight, p.scales, p.zeros, p.bias, p.act_scale)
               if t is not None) + sum(packed_nbytes(q) for q in p.parts)


def _format_module(fmt: str) -> ModuleType:
    name = _QUANTIZED_FORMATS.get(fmt)
    if name is None:
        raise ValueError(f"unknown linear weight format {fmt!r}; expected one of {FORMATS}")
    return importlib.import_module(name)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def dequantize_packed(packed: PackedLinear) -> torch.Tensor:
    """The fp32 [out, in] weights a packed layer actually multiplies by."""
    if packed.parts:
        return torch.cat([dequantize_packed(p) for p in packed.parts], dim=0)
    if packed.fmt in DENSE_FORMATS:
        return packed.weight.float()
    return _format_module(packed.fmt).dequantize(packed)


def packed_linear_reference(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """Plain fp32 torch for any format (w8a8 includes its activation quantization)."""
    x2 = x.reshape(-1, packed.in_features)
    if packed.parts:
        y = torch.cat([packed_linear_reference(x2, p) for p in packed.parts], dim=-1)
    elif packed.fmt in DENSE_FORMATS:
        y = linear_reference(x2, packed.weight, packed.bias)
    else:
        y = _format_module(packed.fmt).reference(x2, packed)
    return y.reshape(*x.shape[:-1], packed.out_features)


def pack_linear(weight: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None, fmt: str, *,
                device: torch.device | str | None = None, smooth: torch.Tensor | None = None,
                smooth_alpha: float = 0.5) -> PackedLinear:
    """weight: [out, in] float tensor or GGUF QuantizedTensor; bias: [out] or None.

    device: where the layer will run (default: the weight's device; CPU for a QuantizedTensor).
    smooth, smooth_alpha: w8a8 only, SmoothQuant statistics (see kernels.quant_w8a8.pack).
    """
    out_features, in_features = weight.shape
    if device is None:
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    if bias is not None:
        if tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match out_features {out_features}")
        bias = bias.float().to(device).contiguous()
    if smooth is not None and fmt != "w8a8":
        raise ValueError(f"smooth is a w8a8 option, not valid for fmt {fmt!r}")
    if fmt == "fp32":
        return PackedLinear(fmt, in_features, out_features, to_float(weight).to(device).contiguous(), bias)
    if fmt == "bf16":
        w = torch.empty(out_features, in_features, dtype=torch.bfloat16)
        for r0, rows in float_row_chunks(weight):
            w[r0:r0 + rows.shape[0]] = rows  # one rounding fp32 -> bf16, as a whole-matrix cast
        return PackedLinear(fmt, in_features, out_features, w.to(device).contiguous(), bias)
    module = _format_module(fmt)
    if fmt == "w8a8":
        return module.pack(weight, bias, device, smooth=smooth, smooth_alpha=smooth_alpha)
    if fmt == "int4a8":  # int4's module and weights; the packed layer keeps the format's name
        return dataclasses.replace(module.pack(weight, bias, device, int8_activations=True), fmt=fmt)
    return module.pack(weight, bias, device)


def linear(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x: [..., in] -> [..., out] in x's dtype."""
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, layer expects {packed.in_features}")
    if packed.parts:
        return torch.cat([linear(x, p) for p in packed.parts], dim=-1)
    if packed.fmt in DENSE_FORMATS:
        xw = x.to(packed.weight.dtype)
        if xw.device.type == "cpu" and batch_invariance.enabled():
            y = batch_invariance.dense_linear(xw.reshape(-1, packed.in_features).contiguous(),
                                              packed.weight).reshape(*x.shape[:-1], packed.out_features)
        else:
            y = torch.nn.functional.linear(xw, packed.weight)
        if packed.bias is not None:
            y = y.float() + packed.bias
        return y.to(x.dtype)
    x2 = x.reshape(-1, packed.in_features)
    y = _format_module(packed.fmt).forward(x2, packed)
    return y.reshape(*x.shape[:-1], packed.out_features)
