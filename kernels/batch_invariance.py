"""Batch-invariant mode: a row's result does not depend on the rows it shares a call with.

Why: a request's rows reach the linears beside whatever else the pass holds. Its prompt is
packed with other prompts, cut into chunks by the token budget, or shortened by a prefix-cache
hit; its decode row sits in a batch of 1 or 60. A kernel whose per-row arithmetic depends on
the number of rows M then gives the same request slightly different logits from run to run,
and a greedy answer parts at the first near-tie (seen on the default model: a repeated chat
answered differently after ~20 tokens, because its prefix-cache hit left 6 prompt rows to
compute instead of 54). Measured on torch 2.13's CPU build (MKL sgemm, oneDNN bf16), one
thread, rows compared bit for bit with the same rows computed at M = 256:

    fp32 F.linear   differs for M < 16 (every shape tried), equal for M >= 16
    bf16 F.linear   differs at shape-dependent M (6..36, and 65 and 100 at 5632x2048)
    int4/int8 native kernels  equal at every M (one row's dot never sees another row), but
                    forward() switches to dequantize + fp32 GEMM from NATIVE_DENSE_MIN_ROWS on
    w8a8            equal (an exact int32 dot, then per-row and per-channel scales)

Off by default, as in vLLM (VLLM_BATCH_INVARIANT) and SGLang (--enable-deterministic-
inference), because it costs prefill speed: on in a process whose environment has
TANDEM_BATCH_INVARIANT=1 (`tandem serve --batch-invariant` and `tandem run --batch-invariant`
set it for every process they start). Then:

- dense CPU linears (fp32, bf16) run as GEMMs of exactly DENSE_TILE_ROWS rows, the last tile
  padded with zero rows: every call has one shape, and a row's result does not depend on its
  place in the tile (checked by tests/kernels/test_batch_invariance.py), so it is the same in
  every pass. Cost on the Sapphire Rapids class host, one thread, 512 rows: fp32 1.1-1.6x,
  bf16 2.1-2.5x the single GEMM; a pass of fewer rows computes the whole tile.
- the native int4/int8 kernels stay on their own kernel at every M (kernels/quant_int4.py,
  kernels/quant_int8.py), and aten's int8 kernel on its own (no bf16 GEMM from 48 rows on).
- attention: each query row of a prefill chunk is attended as a decode at its own position, by
  the native paged decode kernel (kernels/attention.py). SDPA's sums for a row depend on how
  many queries and keys its call holds: a prompt's first chunk of 24 rows differed from the
  same rows of its whole 70-row prefill by 2e-7. The decode kernel computes each (row, kv head)
  alone in one order, the order a later decode step uses too.
- a colocated engine packs one copy, its decode format (engine/llm_engine.py): a pass used the
  prefill copy only when it held no decode token, so a prompt's format depended on its company.

Invariant at a fixed thread count: the native kernels are bit-equal at every count and active
limit, but MKL's fp32 GEMM at 2 threads differs from 1 (3.7e-6 at 300x2048x5632). The torch
fallbacks (no native library) and the GPU (Triton) kernels are not covered.
"""

from __future__ import annotations

import os

import torch

ENV = "TANDEM_BATCH_INVARIANT"
# Rows per dense GEMM call in the mode: fewer costs more per row (16: 2.4-5.8x the single GEMM
# at 512 rows), more wastes more on short chunks and decode rows (measured: 64 -> 1.1-2.5x,
# 256 -> 1.0-1.6x, but a 1-row pass then computes 256).
DENSE_TILE_ROWS = 64

_enabled = os.environ.get(ENV, "") not in ("", "0")


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> bool:
    """Switch the mode for this process (tests, and the CLI before any kernel runs). Returns the
    previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K] in weight's dtype -> [M, N], computed DENSE_TILE_ROWS rows per GEMM call."""
    m, k = x.shape
    tile = DENSE_TILE_ROWS
    out = torch.empty(-(-m // tile) * tile, weight.shape[0], dtype=x.dtype)
    full = m - m % tile
    for r0 in range(0, full, tile):
        torch.mm(x[r0:r0 + tile], weight.t(), out=out[r0:r0 + tile])
    if full < m:
        last = x.new_zeros(tile, k)
        last[:m - full] = x[full:]
        torch.mm(last, weight.t(), out=out[full:])
    return out[:m]
