"""Qwen2: the LLaMA architecture with biases on the q/k/v projections
(ModelConfig.attention_bias), which LlamaForCausalLM already packs when the config asks."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    required_flags = ("attention_bias",)
