"""A GGUF block-quantized matrix kept as raw blocks, so quantized kernels can repack it
without a float round trip (e.g. Q4_1 -> int4 group-wise with zero points)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D GGUF block-quantized matrix, rows = output features.

    data: uint8 array [rows, bytes_per_row]; each row is independent (ggml blocks run along the
    input dimension), so permuting or slicing rows keeps it valid.
    """

    ggml_type: str  # "Q4_0", "Q4_1", "Q8_0", ...
    data: np.ndarray
    shape: tuple[int, int]  # logical (rows, cols)

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        qtype = GGMLQuantizationType[self.ggml_type]
        out = quants.dequantize(np.ascontiguousarray(self.data), qtype)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)

    def take_rows(self, index: np.ndarray) -> "QuantizedTensor":
        return QuantizedTensor(self.ggml_type, self.data[index], (len(index), self.shape[1]))

