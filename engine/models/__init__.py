"""Model families, one file each. A family maps Hugging Face weight names onto its layers and
runs the forward pass through the ops in kernels/; adding a family is adding a file and a line
in FAMILIES."""

from __future__ import annotations

import importlib

from common.errors import UnsupportedModelError

# architecture key (ModelConfig.architecture) -> "module:class"
FAMILIES = {
    "llama": "engine.models.llama:LlamaForCausalLM",
    "mistral": "engine.models.llama:LlamaForCausalLM",
    "qwen2": "engine.models.qwen2:Qwen2ForCausalLM",
    "qwen3": "engine.models.qwen3:Qwen3ForCausalLM",
}


def model_class(architecture: str):
    try:
        module, cls = FAMILIES[architecture].split(":")
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r} (supported: {', '.join(sorted(FAMILIES))})") from None
    return getattr(importlib.import_module(module), cls)
