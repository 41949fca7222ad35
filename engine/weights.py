"""Weights as loaders hand them to the model.

A loader returns a `dict[str, Tensor | QuantizedTensor]` keyed by Hugging Face Llama names
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`, ...). Float tensors are ready to
use. GGUF block-quantized tensors stay as raw blocks (`QuantizedTensor`) so that a quantized
kernel can repack them without a float round trip; `dequantize()` gives fp32 when a format
needs floats.
"""

from __future__ import annotations

from kernels.linear import to_float
from kernels.quantized_tensor import QuantizedTensor

__all__ = ["QuantizedTensor", "to_float"]

