"""Embeddings: a prompt's final normed hidden states, pooled into one vector.

Scheduling. An embedding input is a request like any prompt (Request.pooling): the scheduler
cuts it into chunks under the same per-pass token budget and packs it beside the running
decodes (split-fuse), so a long input delays a concurrent stream by about one pass, never by
its whole length; it waits for blocks in arrival order, can be preempted and recomputed, and
an abort (the client left) ends it between two passes with its blocks freed. Each pass hands
the engine the sum of the chunk's hidden states (ModelRunner.execute `pooled`); the engine
keeps the running sum per request and, once the whole prompt is computed, finishes the request
with the vector below. It samples nothing and never reads the prefix cache (pooling needs
every position's hidden state, which a cached block does not hold).

Pooling. Ollama takes the pooling type from the GGUF's `<arch>.pooling_type` (mean for most
embedding models, CLS or last for some). A decoder-only chat model (SmolLM2, Llama) has none;
for those, mean pooling over every prompt token of the final normed hidden state is the common
choice (sentence-transformers' default, and what llama.cpp's `--pooling mean` does): every
token contributes, so the vector describes the whole text. Last-token pooling (the state that
predicts the next token) is the alternative, used by models trained for it (e5-mistral, GTE-Qwen);
with causal attention it is the only state that has seen the whole text, but in a model never
trained to summarize there, it mostly describes what comes next. The vector is then
L2-normalized, as Ollama's /api/embed does, so a dot product is the cosine.
"""

from __future__ import annotations

import torch


def mean_pooled(hidden_sum: torch.Tensor, num_tokens: int, normalize: bool = True) -> list[float]:
    """hidden_sum: [hidden] fp64, the sum of a prompt's final normed hidden states over its
    `num_tokens` positions. Their mean, L2-normalized when `normalize`."""
    vector = hidden_sum / num_tokens
    if normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.float().tolist()
