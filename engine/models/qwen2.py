"""Qwen2: the LLaMA architecture with biases on the q/k/v projections
(ModelConfig.attention_bias), which LlamaForCausalLM already packs when the config asks."""

from __future__ import annotations

from common.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, weights: dict, weight_format: str = "fp32",
                 lm_head_format: str | None = None, prefill_format: str | None = None,
                 device="cpu") -> None:
        if not config.attention_bias:
            raise ValueError("Qwen2 models carry q/k/v biases: config.attention_bias must be set")
        super().__init__(config, weights, weight_format, lm_head_format, prefill_format, device)
