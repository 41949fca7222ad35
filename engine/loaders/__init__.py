"""Model loaders: a GGUF file or a Hugging Face directory -> config + weights by HF Llama names.

    load_model(path)  -> LoadedModel     config + weights (imports torch)

(`common.model_files.load_config` reads the config alone, torch-free.)

Weights are keyed by Hugging Face Llama names (see `weight_shapes`). `lm_head.weight` is always
present; with tied embeddings it is the same object as `model.embed_tokens.weight`. GGUF
block-quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay raw blocks
(`QuantizedTensor`); float tensors keep their stored dtype. The torch-needing loaders are
imported inside load_model, so importing this package loads no torch.
"""

from __future__ import annotations

from pathlib import Path

from common.model_files import model_format
from engine.loaders.loaded_model import LoadedModel, check_weights, weight_shapes

__all__ = ["LoadedModel", "load_model", "check_weights", "weight_shapes"]


def load_model(path: str | Path) -> LoadedModel:
    """Config and weights of the model at `path` (a .gguf file or a Hugging Face directory)."""
    path = Path(path).expanduser()
    if model_format(path) == "gguf":
        from engine.loaders.gguf_loader import load_gguf

        return load_gguf(path)
    from engine.loaders.hf_loader import load_hf

    return load_hf(path)
