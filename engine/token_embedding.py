"""The token embedding table, kept as the file stores it.

    TokenEmbedding(weight, device)      weight: [vocab, hidden] tensor or GGUF QuantizedTensor
    embedding[ids] -> fp32 [len(ids), hidden]

A pass reads only its tokens' rows, so on the CPU the table stays in the file's own form (GGUF
blocks or F16/BF16 rows viewing the mapped file, or the loader's tensor) and each lookup converts
just those rows: bit-equal to converting the whole table first (ggml rows dequantize on their
own; a float cast is per element), without an fp32 copy of vocab x hidden held for the process's
life (a 49152 x 4096 table: 805 MB; Llama 3's 128256 x 4096: 2.1 GB). On another device the
table is converted to fp32 there once, so lookups stay on the device.

`fp32_table` (an fp32 tensor already made, e.g. a tied fp32 lm_head's weight) is used as the
table instead, so the two share one copy.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.linear import to_float
from kernels.quantized_tensor import QuantizedTensor


class TokenEmbedding:
    def __init__(self, weight: torch.Tensor | QuantizedTensor, device: torch.device,
                 fp32_table: torch.Tensor | None = None) -> None:
        self.shape = tuple(weight.shape)
        self.device = device
        if fp32_table is not None:
            self._table, self._stored = fp32_table, None
        elif device.type == "cpu" and (isinstance(weight, QuantizedTensor) or weight.device.type == "cpu"):
            self._table, self._stored = None, weight
        else:
            self._table, self._stored = to_float(weight).to(device), None

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int [T] -> fp32 [T, hidden] on the table's device."""
        if self._table is not None:
            return self._table[ids]
        if isinstance(self._stored, QuantizedTensor):
            return self._stored.take_rows(np.asarray(ids.cpu(), dtype=np.int64)).dequantize()
        return self._stored[ids].float()

    def table(self) -> torch.Tensor:
        """The whole table in fp32 (tests and tools; a serving pass never needs it)."""
        if self._table is not None:
            return self._table
        return to_float(self._stored)
