"""Tiny random models for tests, built with transformers (the test-only oracle).

    make_tiny_hf_model(dir, ...) -> Path       a Hugging Face directory: config.json,
                                               safetensors, generation_config.json, and a
                                               byte-level BPE tokenizer with a ChatML template
    make_tiny_gguf(path, ggml_type, ...) -> TinyGGUF
                                               the same kind of model written as a llama.cpp
                                               GGUF, plus the HF-layout weights it came from

Both are deterministic in `seed`. Sizes default to a few hundred KB so tests stay fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A model reads the prompt, writes its cache, and
then produces one token at a time. Prefill is bound by compute; decode is bound by memory
bandwidth. Hello, world! How are you today? I am fine, thank you, and how are you?
Numbers such as 12, 345 and 6789 appear in text, as do dates like 2024-05-17 and times 10:30.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
The scheduler admits requests, the workers run them, and the coordinator streams the answer.
Once upon a time there was a little language model that wanted to talk with everyone it met.
It learned words, then sentences, then stories about the river, the mountain and the city.
"""

_HF_CLASSES = {  # arch -> (config class, model class) names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def build_tiny_hf(arch: str = "llama", vocab_size: int = 320, hidden: int = 64, layers: int = 2,
                  heads: int = 4, kv_heads: int = 2, intermediate: int = 128, tie: bool = False,
                  rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                  max_position: int = 512, rope_theta: float = 10000.0,
                  head_dim: int | None = None) -> torch.nn.Module:
    """A random transformers *ForCausalLM in fp32, eval mode. head_dim defaults to
    hidden // heads (Qwen3 sets its own, so q_size may differ from hidden)."""
    import transformers

    if arch not in _HF_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_HF_CLASSES)}, got {arch!r}")
    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[arch])
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
        tie_word_embeddings=tie, max_position_embeddings=max_position, rms_norm_eps=1e-5,
        head_dim=head_dim or hidden // heads,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN), eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None  # Mistral v0.2+; v0.1's 4096 window is tested apart
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    # Random init leaves norms at exactly 1 and biases at 0, which would hide a mix-up of
    # those tensors; perturb them so every weight is distinct.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def make_tiny_hf_model(dir: str | Path, arch: str = "llama", vocab_size: int = 320,
                       hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                       intermediate: int = 128, tie: bool = False,
                       rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                       shards: int = 1, with_tokenizer: bool = True,
                       max_position: int = 512, head_dim: int | None = None) -> Path:
    """Write a random model as a Hugging Face directory and return the directory.

    vocab_size must be >= 259 when with_tokenizer (256 byte tokens + 3 special tokens); the
    tokenizer's vocabulary is exactly vocab_size. shards > 1 splits the safetensors into about
    that many files with an index.
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_hf(arch, vocab_size, hidden, layers, heads, kv_heads, intermediate, tie,
                          rope_scaling, seed, max_position, head_dim=head_dim)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        save_kwargs["max_shard_size"] = max(1, total // shards + 1)
    model.save_pretrained(out, **save_kwargs)
    if with_tokenizer:
        write_tiny_tokenizer(out, vocab_size)
    return out


def train_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly vocab_size tokens, ids 0-2 special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {256 + len(SPECIAL_TOKENS)}, "
                         f"got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the built-in text yields {tokenizer.get_vocab_size()} tokens, not "
                         f"{vocab_size}; ask for a smaller vocab_size")
    return tokenizer


def write_tiny_tokenizer(dir: Path, vocab_size: int) -> None:
    tokenizer = train_tiny_tokenizer(vocab_size)
    tokenizer.save(str(dir / "tokenizer.json"))
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, tok in enumerate(SPECIAL_TOKENS)}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
    }
    (dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


@dataclass(frozen=True)
class TinyGGUF:
    path: Path
    state_dict: dict[str, torch.Tensor]  # HF-layout fp32 weights before quantization
    model: torch.nn.Module  # the transformers model they came from


def _gguf_metadata(writer, arch: str, model: torch.nn.Module, vocab_size: int) -> None:
    c = model.config
    writer.add_name("tiny-test-model")
    writer.add_uint32(f"{arch}.block_count", c.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_key_value_heads)
    writer.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", c.head_dim)
    tokenizer = train_tiny_tokenizer(vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [tok for tok, _ in vocab])
    writer.add_uint32("tokenizer.ggml.bos_token_id", SPECIAL_TOKENS.index(BOS_TOKEN))
    writer.add_uint32("tokenizer.ggml.eos_token_id", SPECIAL_TOKENS.index(EOS_TOKEN))
    writer.add_string("tokenizer.chat_template", CHATML_TEMPLATE)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row permutation for interleaved RoPE."""
    out = w.shape[0]
    head_dim = out // n_head
    return (w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(out, *w.shape[1:]))


_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def encode_matrix(w: np.ndarray, ggml_type: str):
    """(data, raw_dtype) for GGUFWriter.add_tensor: a float matrix stored as `ggml_type`."""
    from gguf import GGMLQuantizationType, quants

    from reliability.kquant_fixtures import quantize_k

    qtype = GGMLQuantizationType[ggml_type]
    if qtype == GGMLQuantizationType.F32:
        return w, None
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16), None
    if ggml_type.endswith("_K"):
        return quantize_k(w, ggml_type), qtype
    return quants.quantize(w, qtype), qtype


def make_tiny_gguf(path: str | Path, ggml_type: str = "F32", arch: str = "llama",
                   vocab_size: int = 320, hidden: int = 64, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 128, tie: bool = False, seed: int = 0,
                   max_position: int = 512, types: dict[str, str] | None = None,
                   store_dequantized: bool = False, head_dim: int | None = None,
                   metadata: dict[str, Any] | None = None) -> TinyGGUF:
    """Write a random model as llama.cpp would convert it: Q/K permuted for arch "llama",
    2-D matrices in `ggml_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K), norms and biases in F32 as llama.cpp keeps them, lm_head omitted when tied.

    types: per-matrix overrides of ggml_type, keyed by GGUF name ("blk.0.attn_v.weight") or
    by the part after the block index ("attn_v.weight", every layer), the exact name winning;
    a Q4_K_M-like mix is {"token_embd.weight": "Q6_K", "output.weight": "Q6_K", ...} with
    ggml_type "Q4_K". K-quants need row lengths (hidden, intermediate) that are multiples
    of 256.

    store_dequantized: write each matrix as F32 holding exactly what its quantized blocks
    dequantize to (by gguf.quants, the oracle), so the same seed and types give the F32
    twin of a quantized file.

    metadata: more keys, as a converted file of that kind holds them (an embedding model's
    {"qwen3.pooling_type": 3, "tokenizer.ggml.add_eos_token": True}): bools, ints as uint32,
    strings."""
    from gguf import GGUFWriter, quants

    types = types or {}
    model = build_tiny_hf(arch, vocab_size, hidden, layers, heads, kv_heads, intermediate, tie,
                          None, seed, max_position, head_dim=head_dim)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    _gguf_metadata(writer, arch, model, vocab_size)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, str(value))

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight"}
    if not tie:
        names["lm_head.weight"] = "output.weight"
    for i in range(layers):
        for hf, gg in _HF_TO_GGUF_LAYER.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    for hf, gg in names.items():
        if hf not in state:
            continue  # biases exist only for qwen2, q/k norms only for qwen3
        w = state[hf].float().numpy()
        if arch == "llama" and gg.split(".", 2)[-1] in ("attn_q.weight", "attn_q.bias"):
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and gg.split(".", 2)[-1] in ("attn_k.weight", "attn_k.bias"):
            w = llama_cpp_permute(w, kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 1:
            writer.add_tensor(gg, w)
        else:
            name = types.get(gg, types.get(gg.split(".", 2)[-1] if gg.startswith("blk.") else gg,
                                           ggml_type))
            data, raw_dtype = encode_matrix(w, name)
            if store_dequantized and raw_dtype is not None:
                data, raw_dtype = quants.dequantize(data, raw_dtype), None
            writer.add_tensor(gg, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path=path, state_dict=state, model=model)
