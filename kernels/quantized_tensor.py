"""A GGUF block-quantized matrix kept as raw blocks, so quantized kernels can repack it
without a float round trip (e.g. Q4_1 -> int4 group-wise with zero points), and any format can
dequantize it one matrix at a time (kernels/ggml_dequant.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.ggml_dequant import dequantize_rows


@dataclass(frozen=True)
class QuantizedTensor:
    """A 2-D GGUF block-quantized matrix, rows = output features.

    data: uint8 array [rows, bytes_per_row]; each row is independent (ggml blocks run along the
    input dimension), so permuting or slicing rows keeps it valid.
    """

    ggml_type: str  # a key of kernels.ggml_dequant.BLOCKS: "Q4_0", "Q4_K", "Q6_K", ...
    data: np.ndarray
    shape: tuple[int, int]  # logical (rows, cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], bit-equal to llama.cpp's dequantize_row_* of the same blocks."""
        return torch.from_numpy(dequantize_rows(self.ggml_type, self.data)).reshape(self.shape)

    def row_slice(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows [start, stop) as a view of the same blocks."""
        data = self.data[start:stop]
        return QuantizedTensor(self.ggml_type, data, (data.shape[0], self.shape[1]))

    def take_rows(self, index: np.ndarray) -> "QuantizedTensor":
        return QuantizedTensor(self.ggml_type, self.data[index], (len(index), self.shape[1]))
