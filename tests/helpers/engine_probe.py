"""Logits of a whole token sequence from an engine, for tests that compare against an oracle."""

from __future__ import annotations

import torch

from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk


def all_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position, in blocks borrowed from the engine's pool (never blocks that
    may hold another prompt's cached prefix); the blocks are free again on return."""
    bm = engine.block_manager
    table = bm.allocate("probe", ids, len(ids), use_prefix_cache=False).block_ids
    try:
        batch = engine.runner.prepare([SequenceChunk(ids, 0, table, True)])
        with torch.inference_mode():
            return engine.model.compute_logits(engine.model.forward(batch, engine.runner.kv_cache))
    finally:
        bm.free("probe")
