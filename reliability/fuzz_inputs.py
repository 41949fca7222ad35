"""Inputs for the loader fuzzer (reliability/fuzz.py): tiny valid seed models and the mutations
applied to them.

The seeds are written from a fixed RNG without transformers, so a mutation recipe (a prefix
length, or a list of byte patches) replays on the same bytes on any machine: the regression
cases under tests/data/fuzz/ are such recipes. They are small on purpose (a ~12 KiB GGUF, a
~10 KiB safetensors file) so that one example costs a millisecond or two and the header, where
every declared count and size lives, is a large share of the bytes a mutation can hit.

A recipe is a dict:
    {"truncate": N}                                  the first N bytes
    {"patches": [[offset, "hex bytes"], ...]}        bytes overwritten in place
    {"config": {"key": value, ...}}                  safetensors target: config.json keys set
    {"header": {"tensor": name, "field": f, "value": v}}  safetensors: a JSON header field set
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np

# The seed model: one llama layer, GQA (2 query heads, 1 kv head), head_dim 16, so that a
# Q8_0 matrix (rows of 32) appears next to F16 and F32 ones.
VOCAB, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 16, 32, 2, 1, 32, 1
HEAD_DIM = HIDDEN // HEADS

# Values that make declared counts and sizes interesting: zero, one, off-by-one around
# powers of two, and the extremes of 32- and 64-bit fields.
INTERESTING = (0, 1, 2, 7, 8, 31, 32, 255, 256, 4096, 65535, 1 << 16, (1 << 31) - 1, 1 << 31,
               (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)


def _shapes() -> dict[str, tuple[int, ...]]:
    """HF name -> torch shape of every weight of the seed model."""
    kv = KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
    return shapes


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) * 0.1
            for name, shape in _shapes().items()}


def write_seed_gguf(path: Path) -> Path:
    """A valid tiny llama GGUF: F16 embeddings, Q8_0 MLP, F32 elsewhere, a token list."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from engine.loaders.gguf_loader import gguf_name

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("fuzz-seed")
    for key, value in (("block_count", LAYERS), ("context_length", 64),
                       ("embedding_length", HIDDEN), ("feed_forward_length", INTERMEDIATE),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                       ("rope.dimension_count", HEAD_DIM)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    writer.add_array("tokenizer.ggml.token_type", [1] * VOCAB)
    # The loader undoes llama.cpp's Q/K row permutation; which rows go where does not matter
    # for a fuzz seed, only that the shapes are right.
    for hf, w in _weights().items():
        name = gguf_name(hf)
        if ".mlp." in hf:
            q8 = GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quants.quantize(w, q8), raw_dtype=q8)
        elif hf == "model.embed_tokens.weight":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_seed_hf(model_dir: Path) -> Path:
    """A valid tiny Hugging Face directory: config.json and one model.safetensors."""
    from safetensors.numpy import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(seed_hf_config()))
    save_file(_weights(), str(model_dir / "model.safetensors"))
    return model_dir


def seed_hf_config() -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_act": "silu"}


# ---- mutations ----------------------------------------------------------------------------

def header_end(gguf: Path) -> int:
    """Where the seed's tensor data starts (its header, where mutations matter most)."""
    from common.gguf_metadata import read_gguf_header

    return read_gguf_header(gguf).data_offset


def random_recipe(rng: random.Random, size: int, hot: int) -> dict[str, Any]:
    """A byte-level mutation of a file of `size` bytes; `hot` bytes at its start (the header)
    get most of the mutations."""
    kind = rng.choice(("truncate", "flip", "word", "word", "splice"))
    if kind == "truncate":
        return {"truncate": rng.randrange(size)}

    def where() -> int:
        return rng.randrange(hot if rng.random() < 0.85 else size)

    patches: list[list[Any]] = []
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        if kind == "flip":
            patches.append([where(), bytes([rng.randrange(256)]).hex()])
        elif kind == "word":
            width = rng.choice((4, 8))
            value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
            at = where() & ~(rng.choice((1, 4)) - 1)
            patches.append([at, value.to_bytes(width, "little").hex()])
        else:  # a run of bytes copied from elsewhere: shifts strings and counts into places
            src, n = where(), rng.randrange(1, 24)
            patches.append([where(), "@" + f"{src}:{n}"])
    return {"patches": patches}


def apply_recipe(seed: bytes, recipe: dict[str, Any]) -> bytes:
    """The mutated bytes of a byte-level recipe (truncate / patches)."""
    if "truncate" in recipe:
        return seed[:recipe["truncate"]]
    out = bytearray(seed)
    for offset, data in recipe.get("patches", ()):
        if data.startswith("@"):  # "@src:n": copy n bytes from src
            src, n = (int(x) for x in data[1:].split(":"))
            chunk = bytes(out[src:src + n])
        else:
            chunk = bytes.fromhex(data)
        out[offset:offset + len(chunk)] = chunk
        del out[len(seed):]  # patches never grow the file; truncation is its own recipe
    return bytes(out)


# Values a hand-edited or corrupted config.json or safetensors header may hold.
_JSON_VALUES: tuple[Any, ...] = (None, True, False, 0, -1, 1, 3, 2.5, -0.0, 1e308, 1 << 62,
                                 (1 << 64) + 1, "", "x", "F16", "silu", [], [0], [1, 2],
                                 [1 << 40, 1 << 40], {}, {"rope_type": "llama3"},
                                 {"type": "linear", "factor": 0})


def random_hf_recipe(rng: random.Random, safetensors: bytes) -> dict[str, Any]:
    """A mutation of the HF seed: of config.json, of the safetensors JSON header, or of bytes."""
    kind = rng.choice(("config", "header", "bytes"))
    if kind == "config":
        keys = list(seed_hf_config()) + ["head_dim", "rope_scaling", "rope_parameters",
                                         "sliding_window", "attention_bias", "mlp_bias"]
        return {"config": {rng.choice(keys): rng.choice(_JSON_VALUES)
                           for _ in range(rng.choice((1, 1, 2)))}}
    if kind == "header":
        tensor = rng.choice(sorted(_shapes()) + ["__metadata__"])
        field = rng.choice(("dtype", "shape", "data_offsets"))
        return {"header": {"tensor": tensor, "field": field, "value": rng.choice(_JSON_VALUES)}}
    (length,) = struct.unpack_from("<Q", safetensors)
    return random_recipe(rng, len(safetensors), 8 + length)


def apply_hf_recipe(model_dir: Path, seed: bytes, recipe: dict[str, Any]) -> None:
    """Write the seed directory with `recipe` applied into `model_dir` (which exists)."""
    config = seed_hf_config()
    config.update(recipe.get("config", {}))
    (model_dir / "config.json").write_text(json.dumps(config))
    data = seed
    if "header" in recipe:
        h = recipe["header"]
        (length,) = struct.unpack_from("<Q", seed)
        header = json.loads(seed[8:8 + length])
        entry = header.setdefault(h["tensor"], {})
        if isinstance(entry, dict):
            entry[h["field"]] = h["value"]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
        data = struct.pack("<Q", len(text)) + text + seed[8 + length:]
    elif "truncate" in recipe or "patches" in recipe:
        data = apply_recipe(seed, recipe)
    (model_dir / "model.safetensors").write_bytes(data)
