"""GGUF file -> LoadedModel, tensors memory-mapped.

Block-quantized matrices (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K, in
any mix per tensor, as Q4_K_M and Q5_K_M files mix them) stay raw blocks in a QuantizedTensor
viewing the mapped file; F32/F16/BF16 become torch tensors viewing it. Nothing is dequantized
here: each role packs a matrix into its weight format when it builds the model, dequantizing
that one matrix (kernels/ggml_dequant.py) unless its format repacks the blocks directly, so
at most one matrix is held as floats beside the mapping at a time. Other ggml types (Q2_K,
Q3_K, IQ*, TQ*, ...) are refused by name. The mapping is copy-on-write ("c"), so tensors
are writable for torch yet never write back to the model file, and untouched pages stay shared
with the page cache.

Q/K rows: llama.cpp's converter permutes the rows of attn_q/attn_k for ggml's interleaved RoPE
(pairs (2j, 2j+1) rotate together) when it writes arch "llama". Hugging Face's rotate-half RoPE
pairs (j, j + head_dim/2), so we undo the permutation per head:

    convert:  w.reshape(n_head, 2, head_dim//2, in).swapaxes(1, 2).reshape(out, in)
    undo:     w.reshape(n_head, head_dim//2, 2, in).swapaxes(1, 2).reshape(out, in)

Rows are independent in a quantized matrix (blocks run along the input dimension), so the same
row gather applies to raw blocks. Qwen2 and Qwen3 use NEOX (rotate-half) RoPE in llama.cpp and
are stored unpermuted.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from common.errors import ModelFormatError, UnsupportedModelError
from engine.loaders.loaded_model import LoadedModel, check_weights, weight_shapes
from common.gguf_metadata import GGUFHeader, gguf_header_config, read_gguf_header
from kernels.ggml_dequant import BLOCKS
from kernels.quantized_tensor import QuantizedTensor

# GGUF tensor name -> Hugging Face Llama name; "{i}" is the block index.
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_HF_TO_GGUF = {v: k for k, v in GGUF_TO_HF.items()}

# general.architecture -> whether llama.cpp permuted Q/K rows for interleaved RoPE.
QK_PERMUTED: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}

# Which head count each permuted tensor is split by (Q: query heads, K: kv heads).
_PERMUTED_BY: dict[str, str] = {
    "attn_q.weight": "num_heads", "attn_q.bias": "num_heads",
    "attn_k.weight": "num_kv_heads", "attn_k.bias": "num_kv_heads",
}

_FLOAT_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.int16,  # reinterpreted as torch.bfloat16 below
}
BLOCK_QUANTIZED = tuple(GGMLQuantizationType[name] for name in BLOCKS)
READ_TYPES = ", ".join(t.name for t in (*_FLOAT_TYPES, *BLOCK_QUANTIZED))


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None if it is not one we map."""
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
        template = GGUF_TO_HF.get(f"blk.{{i}}.{parts[2]}")
        return template.format(i=int(parts[1])) if template else None
    return GGUF_TO_HF.get(name)


def gguf_name(hf: str) -> str:
    """The GGUF name of a Hugging Face weight name (inverse of hf_name), for messages."""
    parts = hf.split(".", 3)
    if hf.startswith("model.layers.") and len(parts) == 4:
        template = _HF_TO_GGUF.get(f"model.layers.{{i}}.{parts[3]}")
        if template:
            return template.format(i=int(parts[2]))
    return _HF_TO_GGUF.get(hf, hf)


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row index that turns llama.cpp's interleaved-RoPE Q/K layout back into HF's."""
    head_dim = rows // n_head
    return np.arange(rows).reshape(n_head, head_dim // 2, 2).swapaxes(1, 2).reshape(rows)


def load_gguf(path: Path) -> LoadedModel:
    header = read_gguf_header(path)
    config = gguf_header_config(header, name=path.stem)
    permuted = QK_PERMUTED[header.metadata["general.architecture"]]
    mapped = np.memmap(path, dtype=np.uint8, mode="c")

    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    for info in header.tensors:
        name = hf_name(info.name)
        if name is None:
            raise UnsupportedModelError(f"{path}: tensor {info.name} has no place in a "
                                        f"{config.architecture} model")
        tensor = _read_tensor(header, mapped, info.name, info.ggml_type, info.shape, info.offset)
        suffix = info.name.split(".", 2)[-1]
        if permuted and suffix in _PERMUTED_BY:
            n_head = getattr(config, _PERMUTED_BY[suffix])
            if tensor.shape[0] % n_head or (tensor.shape[0] // n_head) % 2:
                raise ModelFormatError(f"{path}: tensor {info.name} has {tensor.shape[0]} rows, "
                                       f"not a whole number of even-sized heads for {n_head} heads")
            index = unpermute_rows(tensor.shape[0], n_head)
            tensor = (tensor.take_rows(index) if isinstance(tensor, QuantizedTensor)
                      else tensor[torch.from_numpy(index)])
        weights[name] = tensor

    if config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    check_weights(path, weights, config,
                  {hf: gguf_name(hf) for hf in weight_shapes(config, weights)})
    return LoadedModel(config=config, weights=weights, format="gguf", path=path, generation_config={},
                       mapping=mapped._mmap)


def _read_tensor(header: GGUFHeader, mapped: np.memmap, name: str, type_id: int,
                 shape: tuple[int, ...], offset: int) -> torch.Tensor | QuantizedTensor:
    path = header.path
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(f"{path}: tensor {name} has unknown ggml type id {type_id}") from None
    if qtype not in _FLOAT_TYPES and qtype not in BLOCK_QUANTIZED:
        raise UnsupportedModelError(f"{path}: tensor {name} has ggml type {qtype.name}, which "
                                    f"tandem does not read (supported: {READ_TYPES})")
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ModelFormatError(f"{path}: tensor {name} row length {shape[-1]} is not a multiple "
                               f"of the {qtype.name} block size {block}")
    if any(d == 0 for d in shape):
        # Every weight has a size; a zero dimension would let the others be anything (the
        # size check below passes) and numpy then refuses dimensions past int64.
        raise ModelFormatError(f"{path}: tensor {name} has a zero dimension: {list(shape)}")
    # math.prod over Python ints: np.prod wraps around in int64, so two corrupt dimensions of
    # 2**40 would multiply to 0 bytes and pass the size check.
    n_elements = math.prod(shape)
    n_bytes = n_elements // block * block_bytes
    if offset + n_bytes > header.file_size:
        raise ModelFormatError(f"{path}: truncated: tensor {name} needs bytes up to "
                               f"{offset + n_bytes}, but the file has {header.file_size}")
    raw = mapped[offset:offset + n_bytes]

    if qtype in _FLOAT_TYPES:
        tensor = torch.from_numpy(raw.view(_FLOAT_TYPES[qtype]).reshape(shape))
        return tensor.view(torch.bfloat16) if qtype == GGMLQuantizationType.BF16 else tensor
    if len(shape) != 2:
        raise UnsupportedModelError(f"{path}: tensor {name} is a {len(shape)}-D {qtype.name} "
                                    "tensor; only 2-D matrices may be block-quantized")
    rows, cols = shape
    return QuantizedTensor(qtype.name, raw.reshape(rows, cols // block * block_bytes), (rows, cols))
