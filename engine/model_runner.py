"""Runs the model over one scheduled batch: builds the ForwardBatch tensors, owns the paged KV
cache tensor, returns fp32 logits for the sequences that sample. No policy lives here: what to
run is the scheduler's decision, what to do with the logits is the engine's.

KV cache: one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(dim 1: K, V). Block b of every layer belongs to whichever request's block table holds b; the
block manager decides that, the runner only writes slots it is given.

Device: the cache and every batch tensor live on the model's device (`model.device`, CPU
when the model does not say); the batch is built on the host and copied over in one go per
tensor. On CUDA, decode steps replay captured CUDA graphs (engine/cuda_graphs.py) unless
`cuda_graphs` is False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.config import CacheConfig
from common.model_config import ModelConfig
from common.pooling import Pooling
from engine.embedding import pool_state
from engine.cuda_graphs import DecodeGraphRunner
from engine.forward_batch import ForwardBatch
from kernels._triton import use_triton


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a forward pass."""

    token_ids: Sequence[int]  # the new tokens of this pass (1 for a decode)
    start_pos: int  # position of token_ids[0]; tokens before it are already cached
    block_table: Sequence[int]  # covers start_pos + len(token_ids) slots
    needs_logits: bool  # True when this pass reaches the sequence's last token
    # With needs_logits: how many trailing tokens' rows become logits. 1 but for a speculative
    # verification (engine/speculative.py): the last real token and each draft token.
    num_logits: int = 1
    # The sequence is past its prompt (feeds back a generated token): set by the engine.
    # None: unknown, a one-token chunk counts as a decode.
    is_decode: bool | None = None
    # Prompt logprobs: indexes into token_ids whose logits the engine also wants (each
    # position's distribution over the next prompt token). Empty for every other request.
    prompt_logits: range = range(0)
    # Embeddings: the engine wants this chunk's pooling state (engine/embedding.pool_state: the
    # sum of its final hidden states for mean pooling, its last one for last), which it folds
    # across the passes of a chunked prompt. None for every other chunk.
    pool_hidden: Pooling | None = None

    @property
    def decodes(self) -> bool:
        return self.is_decode if self.is_decode is not None else len(self.token_ids) == 1


def kv_cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    return (model.num_layers, 2, cache.num_blocks, cache.block_size, model.num_kv_heads, model.head_dim)


def kv_cache_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model, cache_config: CacheConfig, kv_dtype: torch.dtype = torch.float32,
                 kv_cache: torch.Tensor | None = None, cuda_graphs: bool = True) -> None:
        self.model = model
        self.block_size = cache_config.block_size
        self.device = torch.device(getattr(model, "device", "cpu"))
        shape = kv_cache_shape(model.config, cache_config)
        if kv_cache is not None and tuple(kv_cache.shape) != shape:
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected {shape}")
        if kv_cache is not None and kv_cache.device != self.device:
            raise ValueError(f"kv_cache is on {kv_cache.device}, the model on {self.device}")
        # A caller-provided cache (e.g. in shared memory for a same-host KV receiver) is used
        # as is; otherwise allocate.
        self.kv_cache = (kv_cache if kv_cache is not None
                         else torch.zeros(shape, dtype=kv_dtype, device=self.device))
        self.graphs: DecodeGraphRunner | None = None
        if cuda_graphs and self.device.type == "cuda" and use_triton(self.kv_cache):
            self.graphs = DecodeGraphRunner(model, self.kv_cache, capture=True)

    def prepare(self, chunks: Sequence[SequenceChunk]) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []  # after the sampling rows (execute's docstring)
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            if len(c.block_table) * bs < end:
                raise ValueError(f"block table of {len(c.block_table)} blocks cannot hold {end} tokens")
            input_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, end))
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in range(c.start_pos, end))
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            tables[b, :len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
            if c.needs_logits:
                if not 1 <= c.num_logits <= n:
                    raise ValueError(f"num_logits {c.num_logits} must be in 1..{n}, the chunk's tokens")
                logits_indices.extend(range(cu[-1] - c.num_logits, cu[-1]))
            prompt_indices.extend(cu[-2] + i for i in c.prompt_logits)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.int64),
            has_decode=any(c.decodes for c in chunks),
            # Verifications only (no prompt chunk): rows attended as decodes (ForwardBatch).
            rows_as_decodes=all(c.decodes for c in chunks) and any(len(c.token_ids) > 1
                                                                    for c in chunks),
        ).to(self.device)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SequenceChunk],
                on_layer_done: Callable[[int], None] | None = None,
                pooled: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one forward pass; returns fp32 logits [sum of num_logits over the chunks needing
        logits, vocab], in chunk order (a chunk's rows in token order), followed by the rows of every chunk's prompt_logits, in chunk order
        (none unless a chunk asks). `pooled`, when given, receives chunk index -> that chunk's
        pooling state (fp64 [hidden], engine/embedding.pool_state), for every chunk with pool_hidden."""
        if (self.graphs is not None and on_layer_done is None and pooled is None and self.graphs.accepts(
                [len(c.token_ids) for c in chunks], [len(c.block_table) for c in chunks],
                all(c.needs_logits and not c.prompt_logits for c in chunks))):
            if self.graphs.model is not self.model:  # weights reloaded (keep_alive): new graphs
                self.graphs = DecodeGraphRunner(self.model, self.kv_cache, capture=self.graphs.capture)
            return self.graphs.run(self.prepare(chunks))
        batch = self.prepare(chunks)
        batch.on_layer_done = on_layer_done
        hidden = self.model.forward(batch, self.kv_cache)
        if pooled is not None:
            cu = batch.cu_seqlens_q.tolist()
            for i, c in enumerate(chunks):
                if c.pool_hidden:
                    pooled[i] = pool_state(c.pool_hidden, hidden[cu[i]:cu[i + 1]])
        if batch.logits_indices.numel() == 0:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return self.model.compute_logits(hidden[batch.logits_indices], batch)
