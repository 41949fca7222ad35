"""Decode steps replayed as CUDA graphs, one per padded batch size (as vLLM and gpt-fast do).

A decode step of a small model is a few hundred kernel launches of a few microseconds each;
on a GPU the host's launch overhead, not the kernels, sets the step time. A CUDA graph records
the launches once and replays them with one call.

A graph replays fixed shapes at fixed addresses, so each bucket (1, 2, 4, 8, ... sequences)
owns static input buffers; a step of B sequences runs in the smallest bucket >= B, its rows
copied into the buffers and the rest padded:

    input_ids   0          positions  0          seq_lens  1
    slot_mapping -1        block_tables row of 0s

Invariant: padding rows never write the KV pool. Their slot is -1, which every KV write path
skips (kernels/kv_cache_write.py, kernels/csrc/rotary_kv_write.cpp), so a padded step, and a
capture itself, leave every block exactly as the real rows left it. Padding rows read block 0
(one position) and compute garbage that no one reads: every op of the model is row-wise
except attention, which reads only the row's own sequence. Logits of rows >= B are dropped.

Capture itself runs only on CUDA (`capture=True`, with the Triton kernels, whose launches read
no device value on the host). With `capture=False` the same bucket, padding and static-buffer
logic runs eagerly, on any device: that is how the CPU tests check it. The model runner uses
this class only on CUDA, unless told not to (`--no-cuda-graphs`); CPU steps run unpadded.
A graph is captured lazily, the first time its bucket is needed, from a private memory pool
shared by all buckets.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from kernels._triton import use_triton

# Batch sizes that get a graph; a larger decode step runs eagerly.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PAD_SLOT = -1  # "not written" for every KV write path


class DecodeGraphRunner:
    """Runs pure-decode steps (one token per sequence, every sequence sampling) of `model`
    over `kv_cache` in padded buckets; `capture` records and replays CUDA graphs."""

    def __init__(self, model, kv_cache: torch.Tensor, *, capture: bool,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive sizes, got {buckets}")
        if capture and not (kv_cache.is_cuda and use_triton(kv_cache)):
            raise ValueError("CUDA graph capture needs the model on CUDA with the Triton kernels "
                             "(the CPU paths read device values on the host)")
        self.model = model
        self.kv_cache = kv_cache
        self.capture = capture
        self.buckets = tuple(buckets)
        self.block_size = kv_cache.shape[3]
        num_blocks = kv_cache.shape[2]
        # Widest block table a sequence can have: the model's context, or the whole pool.
        self.max_blocks = min(num_blocks, -(-model.config.max_position // self.block_size))
        self._static: dict[int, ForwardBatch] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self.replays = 0  # steps served from a graph (or, eagerly, from the static buffers)

    def release(self) -> None:
        """Drops the model, the graphs and their memory (the engine unloading its weights);
        the runner builds a new instance for the next model it runs."""
        self.model = None
        self._graphs.clear()
        self._outputs.clear()
        self._static.clear()
        self._pool = None

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding num_seqs sequences, or None past the largest."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def accepts(self, token_counts: list[int], table_lens: list[int], all_sample: bool) -> bool:
        """Whether a step (host-side facts only: tokens per sequence, block-table lengths,
        whether every sequence samples and none wants prompt logits) fits a bucket."""
        return (all_sample and bool(token_counts) and all(n == 1 for n in token_counts)
                and self.bucket_for(len(token_counts)) is not None
                and max(table_lens) <= self.max_blocks)

    def _buffers(self, bucket: int) -> ForwardBatch:
        if bucket not in self._static:
            dev = self.kv_cache.device
            self._static[bucket] = ForwardBatch(
                input_ids=torch.zeros(bucket, dtype=torch.int64, device=dev),
                positions=torch.zeros(bucket, dtype=torch.int64, device=dev),
                slot_mapping=torch.full((bucket,), PAD_SLOT, dtype=torch.int64, device=dev),
                cu_seqlens_q=torch.arange(bucket + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.ones(bucket, dtype=torch.int32, device=dev),
                block_tables=torch.zeros(bucket, self.max_blocks, dtype=torch.int32, device=dev),
                logits_indices=torch.arange(bucket, dtype=torch.int64, device=dev),
                has_decode=True,
            )
        return self._static[bucket]

    def _fill(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        """Copies a B-sequence decode batch into a bucket's buffers and resets the padding
        rows (a previous, larger step may have left real values there)."""
        b = batch.seq_lens.shape[0]
        static.input_ids[:b].copy_(batch.input_ids)
        static.input_ids[b:].zero_()
        static.positions[:b].copy_(batch.positions)
        static.positions[b:].zero_()
        static.slot_mapping[:b].copy_(batch.slot_mapping)
        static.slot_mapping[b:].fill_(PAD_SLOT)
        static.seq_lens[:b].copy_(batch.seq_lens)
        static.seq_lens[b:].fill_(1)
        static.block_tables.zero_()
        static.block_tables[:b, :batch.block_tables.shape[1]].copy_(batch.block_tables)

    def _forward(self, static: ForwardBatch) -> torch.Tensor:
        hidden = self.model.forward(static, self.kv_cache)
        return self.model.compute_logits(hidden[static.logits_indices], static)

    def _capture(self, bucket: int, static: ForwardBatch) -> None:
        # Warm-up on a side stream compiles the Triton kernels outside the capture; the
        # padding-only buffers make both the warm-up and the capture write no KV.
        stream = torch.cuda.Stream(self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[bucket] = self._forward(static)
        self._graphs[bucket] = graph

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """batch: a decode step that `accepts` approved, on the cache's device -> fp32 logits
        [B, vocab] (a copy: the graph's output buffer is overwritten by the next replay)."""
        b = batch.seq_lens.shape[0]
        bucket = self.bucket_for(b)
        static = self._buffers(bucket)
        self.replays += 1
        if not self.capture:
            self._fill(static, batch)
            return self._forward(static)[:b]
        if bucket not in self._graphs:
            self._fill(static, _padding_only(batch))
            self._capture(bucket, static)
        self._fill(static, batch)
        self._graphs[bucket].replay()
        return self._outputs[bucket][:b].clone()


def _padding_only(batch: ForwardBatch) -> ForwardBatch:
    """A zero-sequence batch: filling a bucket with it makes every row padding (no KV writes)."""
    empty = batch.input_ids[:0]
    return ForwardBatch(empty, empty, empty, batch.cu_seqlens_q[:1], batch.seq_lens[:0],
                        batch.block_tables[:0], empty, has_decode=True)
