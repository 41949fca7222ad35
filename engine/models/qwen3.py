"""Qwen3 (dense): the LLaMA architecture with per-head RMSNorm on q and k before RoPE
(ModelConfig.qk_norm, weights self_attn.q_norm/k_norm [head_dim]) and no q/k/v biases, which
LlamaForCausalLM applies when the config asks. head_dim is its own setting (128 in the
published models), so q_size may differ from hidden_size."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    required_flags = ("qk_norm",)
