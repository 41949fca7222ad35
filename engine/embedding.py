"""Embeddings: a prompt's final normed hidden states, pooled into one vector.

Scheduling. An embedding input is a request like any prompt (Request.pooling): the scheduler
cuts it into chunks under the same per-pass token budget and packs it beside the running
decodes (split-fuse), so a long input delays a concurrent stream by about one pass, never by
its whole length; it waits for blocks in arrival order, can be preempted and recomputed, and
an abort (the client left) ends it between two passes with its blocks freed. Each pass hands
the engine the chunk's pooling state (pool_state: the sum of its hidden states, or its last
one; ModelRunner.execute `pooled`); the engine folds them per request (pool_step; chunks of one
request run in order, one per pass) and, once the whole prompt is computed, finishes the
request with the vector (pooled_vector). It samples nothing and never reads the prefix cache
(pooling needs every position's hidden state, which a cached block does not hold).

Pooling. Ollama takes the pooling type from the GGUF's `<arch>.pooling_type` (mean for most
embedding models, CLS or last for some). A decoder-only chat model (SmolLM2, Llama) has none;
for those, mean pooling over every prompt token of the final normed hidden state is the common
choice (sentence-transformers' default, and what llama.cpp's `--pooling mean` does): every
token contributes, so the vector describes the whole text. Last-token pooling (the state that
predicts the next token) is the alternative, used by models trained for it (e5-mistral, GTE-Qwen,
Qwen3-Embedding); with causal attention it is the only state that has seen the whole text, but
in a model never trained to summarize there, it mostly describes what comes next, unless the
input asks for a summary: PromptEOL (Jiang et al., 2023, "Scaling Sentence Embeddings with
Large Language Models") wraps the text in `This sentence : "..." means in one word:"` so that
the next token, and so the last state, is the text's meaning in one word. The response cache
embeds so (coordinator/response_cache.py); requests choose with `pooling` (common/pooling.py).
The vector is then L2-normalized, as Ollama's /api/embed does, so a dot product is the cosine.
"""

from __future__ import annotations

import torch

from common.pooling import Pooling


def pool_state(pooling: Pooling, hidden: torch.Tensor) -> torch.Tensor:
    """One chunk's contribution, fp64 [hidden], from its final normed hidden states
    [tokens, hidden]: their sum (mean), or the last position's (last)."""
    if pooling is Pooling.LAST:
        return hidden[-1].double()
    return hidden.double().sum(dim=0)


def pool_step(pooling: Pooling, state: torch.Tensor | None, chunk: torch.Tensor) -> torch.Tensor:
    """A request's state after its next chunk (state None before its first): the running sum
    (mean), or the newest chunk's last position (last: a later chunk's is nearer the end)."""
    if pooling is Pooling.LAST or state is None:
        return chunk
    return state + chunk


def pooled_vector(pooling: Pooling, state: torch.Tensor, num_tokens: int,
                  normalize: bool = True) -> list[float]:
    """The vector of a prompt of `num_tokens` positions whose whole state is `state`: the mean
    (mean) or the last position's state (last), L2-normalized when `normalize`."""
    vector = state / num_tokens if pooling is Pooling.MEAN else state
    if normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.float().tolist()
