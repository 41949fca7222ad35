"""Hugging Face directory -> LoadedModel.

Reads config.json, generation_config.json (optional) and safetensors weights: one
`model.safetensors`, or shards listed in `model.safetensors.index.json`. PyTorch pickles
(`*.bin`) are not read: unpickling runs code from the file. Only the tensors the model needs are
read, so extras such as old checkpoints' `rotary_emb.inv_freq` buffers are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from common.errors import ModelFormatError
from engine.loaders.loaded_model import LoadedModel, check_weights, weight_shapes
from common.hf_config import read_hf_config, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(model_dir: Path) -> dict[str, list[str]]:
    """Safetensors file -> names that the index assigns it; [] means 'read its own listing'."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index_path}: no weight_map")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: []}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not found:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" ({', '.join(bins)} are PyTorch pickles, which tandem does not read)" if bins else ""
        raise ModelFormatError(f"{model_dir}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    return {name: [] for name in found}


def _read(file_path: Path, read: Callable[[Any], Any]) -> Any:
    """`read(f)` on the open safetensors file; ModelFormatError naming it if that fails."""
    try:
        with safe_open(str(file_path), framework="pt") as f:
            return read(f)
    except (SafetensorError, OSError) as e:
        raise ModelFormatError(f"{file_path}: cannot read safetensors: {e}") from e


def load_hf(model_dir: Path) -> LoadedModel:
    config = read_hf_config(model_dir)
    listing: dict[Path, list[str]] = {}
    for file, names in weight_files(model_dir).items():
        file_path = model_dir / file
        if not file_path.is_file():
            raise ModelFormatError(f"{model_dir}: {INDEX_FILE} lists {file}, which is missing")
        listing[file_path] = names or _read(file_path, lambda f: list(f.keys()))
    # The names the files hold bound the layers listed (weight_shapes): a config.json that
    # says 10**12 layers is a missing tensor, not a loop of 10**12.
    wanted = weight_shapes(config, [n for names in listing.values() for n in names])
    weights: dict[str, torch.Tensor] = {}
    for file_path, names in listing.items():
        weights.update(_read(file_path, lambda f: {n: f.get_tensor(n) for n in names
                                                   if n in wanted}))

    if config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        # Tied means one tensor: a stored copy of lm_head (some checkpoints keep one) is dropped.
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    check_weights(model_dir, weights, config)

    generation_path = model_dir / "generation_config.json"
    generation_config = read_json(generation_path) if generation_path.is_file() else {}
    return LoadedModel(config=config, weights=weights, format="hf", path=model_dir,
                       generation_config=generation_config)
