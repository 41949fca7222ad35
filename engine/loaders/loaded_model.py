"""What a loader returns, and the checks every loader runs on the weights it read.

Weights are keyed by Hugging Face Llama names (see `weight_shapes`). `lm_head.weight` is always
present; with tied embeddings it is the same object as `model.embed_tokens.weight`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import ModelFormatError
from common.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from kernels.quantized_tensor import QuantizedTensor


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor | QuantizedTensor]  # HF Llama names, see weight_shapes()
    format: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the HF directory
    generation_config: dict[str, Any]  # HF generation_config.json contents; {} for GGUF
    # The GGUF file's mapping (mmap.mmap) that raw blocks and float tensors view; None for HF.
    mapping: Any = None

    def drop_resident_pages(self) -> None:
        """Unmaps the file's pages from this process once a model is built from the weights:
        packing read every matrix, so all of the file counted in RssFile although the packed
        formats hold their own copies. The mapping stays valid (it is private and never
        written), so what still views it (an embedding table kept as blocks, fp32 views of
        an F32 file) faults its pages back from the page cache when read."""
        if self.mapping is not None:
            import mmap

            self.mapping.madvise(mmap.MADV_DONTNEED)


def weight_shapes(config: ModelConfig, present: Iterable[str] | None = None
                  ) -> dict[str, tuple[int, ...]]:
    """Every weight a model of this config needs, lm_head.weight included, with its torch shape
    ([out_features, in_features] for projections).

    `present`: the HF names a file holds. The layers are then listed only up to one past the
    number of layers those names cover: a corrupt block_count of 2**60 must not become a loop
    of 2**60 layers. The listing stays in order and still includes a layer the file lacks
    whenever the config claims more than it holds, so check_weights names the same first
    missing tensor as it would with every layer listed."""
    c = config
    if present is not None:
        held = {n.split(".", 3)[2] for n in present if n.startswith("model.layers.")}
        c = replace(c, num_layers=min(c.num_layers, len(held) + 1))
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for proj, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, c.hidden_size)
            if c.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def check_weights(path: Path, weights: dict[str, Any], config: ModelConfig,
                  source_names: dict[str, str] | None = None) -> None:
    """ModelFormatError naming the first missing or misshapen tensor. `source_names` maps HF
    names back to the file's own names so that the message names what the user can find."""
    for name, shape in weight_shapes(config, weights).items():
        shown = (source_names or {}).get(name, name)
        if name not in weights:
            raise ModelFormatError(f"{path}: missing tensor {shown}")
        got = tuple(weights[name].shape)
        if got != shape:
            raise ModelFormatError(f"{path}: tensor {shown} has shape {list(got)}, but the config "
                                   f"implies {list(shape)}")
