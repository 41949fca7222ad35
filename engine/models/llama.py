"""The LLaMA family (Llama 1-3, Mistral, SmolLM): RMSNorm, RoPE, GQA attention, SwiGLU.

Plain PyTorch over the ops in kernels/. Weights are packed once at load: q/k/v fused into one
projection and gate/up into another (one GEMM each instead of three and two). The residual
stream stays fp32; each linear casts to its weight format; logits are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelFormatError
from engine.forward_batch import ForwardBatch
from engine.rope import rope_tables
from engine.weights import QuantizedTensor, to_float
from kernels.activation import silu_and_mul
from kernels.attention import paged_attention, plan_paged_attention
from kernels.kv_cache_write import write_kv_cache
from kernels.linear import PackedLinear, linear, pack_linear
from kernels.rms_norm import rms_norm
from kernels.rotary import apply_rotary


def concat_rows(parts: list[torch.Tensor | QuantizedTensor]) -> torch.Tensor | QuantizedTensor:
    """Stack matrices along the output dimension. GGUF blocks run along the input dimension,
    so raw quantized rows concatenate as they are when all parts share one ggml type."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and len({p.ggml_type for p in parts}) == 1:
        data = np.concatenate([p.data for p in parts], axis=0)
        return QuantizedTensor(parts[0].ggml_type, data, (data.shape[0], parts[0].shape[1]))
    return torch.cat([to_float(p) for p in parts], dim=0)


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: PackedLinear
    o_proj: PackedLinear
    post_attention_norm: torch.Tensor
    gate_up: PackedLinear
    down: PackedLinear


# Passes with at least this many tokens use the prefill weight format (compute-bound GEMMs);
# smaller ones, decode steps, the decode format (memory-bound GEMVs). Around this size int4
# weight-only kernels stop beating int8 GEMMs on a CPU (kernels/bench_linear.py).
PREFILL_MIN_TOKENS = 32

# The lm_head reads the whole vocabulary every step; int8 halves bf16's bytes and keeps the
# logits (computed in fp32) close enough that greedy choices hold.
LM_HEAD_FORMAT = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int8", "w8a8": "int8"}


class LlamaForCausalLM:
    """weight_format packs the projections for decode; prefill_format (if different) packs a
    second copy for large passes, so one model serves both phases in its best format."""

    def __init__(self, config: ModelConfig, weights: dict, weight_format: str = "fp32",
                 lm_head_format: str | None = None, prefill_format: str | None = None) -> None:
        self.config = config
        self.weight_format = weight_format
        self.prefill_format = prefill_format or weight_format
        get = self._getter(weights)
        self.embed_tokens = to_float(get("model.embed_tokens.weight"))
        self.layers = [self._load_layer(get, i, weight_format) for i in range(config.num_layers)]
        self.prefill_layers = self.layers if self.prefill_format == weight_format else [
            self._load_layer(get, i, self.prefill_format) for i in range(config.num_layers)]
        self.norm = to_float(get("model.norm.weight"))
        lm_head = get("lm_head.weight")
        head_fmt = lm_head_format or LM_HEAD_FORMAT[weight_format]
        if head_fmt == "fp32" and lm_head is weights.get("model.embed_tokens.weight"):
            # Tied and already fp32: share the embedding matrix instead of a second copy.
            self.lm_head = PackedLinear("fp32", config.hidden_size, config.vocab_size, self.embed_tokens)
        else:
            self.lm_head = pack_linear(lm_head, None, head_fmt)
        self.cos, self.sin = rope_tables(config.head_dim, config.max_position, config.rope_theta,
                                         config.rope_scaling)
        self.scale = config.head_dim ** -0.5

    @staticmethod
    def _getter(weights: dict):
        def get(name: str):
            try:
                return weights[name]
            except KeyError:
                raise ModelFormatError(f"weight {name!r} is missing from the model") from None
        return get

    def _load_layer(self, get, i: int, fmt: str) -> DecoderLayer:
        p = f"model.layers.{i}."
        qkv_bias = None
        if self.config.attention_bias:
            qkv_bias = torch.cat([to_float(get(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
        return DecoderLayer(
            input_norm=to_float(get(p + "input_layernorm.weight")),
            qkv=pack_linear(concat_rows([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]), qkv_bias, fmt),
            o_proj=pack_linear(get(p + "self_attn.o_proj.weight"), None, fmt),
            post_attention_norm=to_float(get(p + "post_attention_layernorm.weight")),
            gate_up=pack_linear(concat_rows([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]), None, fmt),
            down=pack_linear(get(p + "mlp.down_proj.weight"), None, fmt),
        )

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns the final hidden states [T, hidden] (fp32)."""
        cfg = self.config
        t = batch.num_tokens
        hidden = self.embed_tokens[batch.input_ids]
        residual = None
        layers = self.prefill_layers if t >= PREFILL_MIN_TOKENS else self.layers
        plan = plan_paged_attention(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, kv_cache.shape[3])
        for i, layer in enumerate(layers):
            x, residual = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = linear(x, layer.qkv)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rotary(q, k, batch.positions, self.cos, self.sin)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            if batch.on_layer_done is not None:
                batch.on_layer_done(i)
            attn = paged_attention(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                   batch.block_tables, self.scale, plan)
            hidden = linear(attn.reshape(t, cfg.q_size), layer.o_proj)
            x, residual = rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps, residual)
            hidden = linear(silu_and_mul(linear(x, layer.gate_up)), layer.down)
        hidden, _ = rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> fp32 logits [S, vocab]."""
        return linear(hidden, self.lm_head).float()
