"""Embeddings: a prompt's final normed hidden states, pooled into one vector. Runs on the engine
thread (worker/engine_loop.py `call`), between two steps.

Pooling. Ollama takes the pooling type from the GGUF's `<arch>.pooling_type` (mean for most
embedding models, CLS or last for some). A decoder-only chat model (SmolLM2, Llama) has none;
for those, mean pooling over every prompt token of the final normed hidden state is the common
choice (sentence-transformers' default, and what llama.cpp's `--pooling mean` does): every
token contributes, so the vector describes the whole text. Last-token pooling (the state that
predicts the next token) is the alternative, used by models trained for it (e5-mistral, GTE-Qwen);
with causal attention it is the only state that has seen the whole text, but in a model never
trained to summarize there, it mostly describes what comes next. The vector is then
L2-normalized, as Ollama's /api/embed does, so a dot product is the cosine.

KV. The forward pass needs somewhere to write each layer's K/V for the attention kernels; it
takes fresh blocks from the engine's own pool (never prefix-cache hits: a cached block may have
been computed in another weight format) under a temporary owner, and frees them before
returning, whatever happens: no block outlives the call, and no registered prefix is added.
A batch that cannot get its blocks now raises EmbedBusy; the caller answers "retry".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from engine.model_runner import SequenceChunk

_OWNERS = itertools.count()


class EmbedBusy(RuntimeError):
    """The KV pool has too few free blocks for this batch right now."""


def pool(hidden: torch.Tensor, cu_seqlens: Sequence[int], normalize: bool = True) -> list[list[float]]:
    """hidden: [T, H] fp32 final normed states of a ragged batch; cu_seqlens: the batch's token
    offsets (len = sequences + 1). The mean over each sequence's tokens, L2-normalized."""
    out = []
    for a, b in itertools.pairwise(cu_seqlens):
        v = hidden[a:b].double().mean(dim=0)
        if normalize:
            v = v / v.norm().clamp_min(1e-12)
        out.append(v.float().tolist())
    return out


@torch.inference_mode()
def embed_batch(engine, inputs: Sequence[Sequence[int]], normalize: bool = True) -> list[list[float]]:
    """Pooled embeddings of `inputs` (token id lists, each non-empty and within the model's
    length), in one forward pass. Engine thread only."""
    bm = engine.block_manager
    owners = [f"embed#{next(_OWNERS)}" for _ in inputs]
    try:
        chunks = []
        for owner, ids in zip(owners, inputs):
            alloc = bm.allocate(owner, ids, len(ids), use_prefix_cache=False)
            if alloc is None:
                raise EmbedBusy(f"the worker's KV pool has {bm.num_free_blocks} free blocks, too few "
                                f"to embed {sum(map(len, inputs))} tokens now")
            chunks.append(SequenceChunk(list(ids), 0, alloc.block_ids, needs_logits=False,
                                        is_decode=False))
        batch = engine.runner.prepare(chunks)
        hidden = engine.model.forward(batch, engine.runner.kv_cache)
        return pool(hidden.float(), batch.cu_seqlens_q.tolist(), normalize)
    finally:
        for owner in owners:
            bm.free(owner)


def plan_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indexes of inputs grouped into forward passes of at most `budget` tokens (an input
    longer than that goes alone), in order, so that decode steps run between passes."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups
