"""The KV cache's element type and size: the names --kv-dtype takes, and how many blocks a
byte budget holds for a model (the engine sizes its cache with it; a decode worker sizes the
receiver's buffer with it before the engine exists)."""

from __future__ import annotations

from dataclasses import replace

import torch

from common.model_config import ModelConfig
from engine.config import KV_DTYPE_TORCH_NAMES, KV_DTYPES, CacheConfig, check_kv_dtype
from engine.model_runner import kv_cache_bytes_per_block

# CacheConfig.kv_dtype -> the element type of the cache tensor.
KV_TORCH_DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in KV_DTYPE_TORCH_NAMES.items()}


def kv_dtype_name(value: str | torch.dtype) -> str:
    """The KV_DTYPES name ("fp32", "bf16") of `value`, given as that name or as the torch
    dtype; ValueError for anything else."""
    if isinstance(value, torch.dtype):
        for name, dtype in KV_TORCH_DTYPES.items():
            if dtype == value:
                return name
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} "
                         f"(torch.float32, torch.bfloat16), got {value}")
    return check_kv_dtype(value)


def sized_cache(cache: CacheConfig, model: ModelConfig) -> CacheConfig:
    """`cache` with num_blocks known: as given, else as many blocks of `model`'s KV as
    cache.kv_cache_bytes holds (at least one)."""
    if cache.num_blocks is not None:
        return cache
    per_block = kv_cache_bytes_per_block(model, cache.block_size, KV_TORCH_DTYPES[cache.kv_dtype])
    return replace(cache, num_blocks=max(1, cache.kv_cache_bytes // per_block))
