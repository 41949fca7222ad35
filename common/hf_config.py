"""Hugging Face `config.json` -> ModelConfig, torch-free.

Two spellings of RoPE settings exist in the wild: `rope_theta` + `rope_scaling` (transformers 4.x
and most published checkpoints) and `rope_parameters` holding both (transformers 5 writes this).
Both are read; `rope_parameters` wins when present because it is the newer writer's truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.model_config import ModelConfig, RopeScaling
from common.errors import ModelFormatError, UnsupportedModelError

# model_type -> (ModelConfig.architecture, attention_bias default, qk_norm). SmolLM is
# model_type llama.
HF_MODEL_TYPES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("llama", False, False),
    "mistral": ("mistral", False, False),
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Model types whose sliding_window applies only when use_sliding_window is true (their configs
# carry a window even when the model attends fully).
SLIDING_WINDOW_FLAGGED = {"qwen2", "qwen3"}

def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or ModelFormatError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_hf_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig of a Hugging Face model directory, named after the directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{model_dir}: no config.json, so not a Hugging Face model directory")
    config_json = read_json(config_path)
    try:
        return hf_model_config(config_json, name=model_dir.name)
    except (ModelFormatError, UnsupportedModelError) as e:
        raise type(e)(f"{config_path}: {e}") from e


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def hf_model_config(config_json: dict[str, Any], name: str = "model") -> ModelConfig:
    """ModelConfig from the parsed contents of a Hugging Face config.json."""
    model_type = config_json.get("model_type")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        archs = config_json.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        known = [HF_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES]
        if not known:
            raise UnsupportedModelError(
                f"model_type {model_type!r} / architectures {archs} is not supported "
                f"(supported: {sorted(HF_ARCHITECTURES)})")
        model_type = known[0]
    family, default_bias, qk_norm = HF_MODEL_TYPES[model_type]

    missing = [k for k in _REQUIRED if k not in config_json]
    if missing:
        raise ModelFormatError(f"config.json lacks {', '.join(missing)}")
    if config_json.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config_json['hidden_act']!r} is not supported "
                                    "(supported: silu)")
    if config_json.get("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not supported")

    num_heads = _count(config_json, "num_attention_heads")
    hidden = _count(config_json, "hidden_size")
    head_dim = _count(config_json, "head_dim", None) or hidden // num_heads
    try:
        rope_theta, rope_scaling = _rope(config_json)
    except (ValueError, TypeError) as e:  # TypeError: float() of a list, a non-object entry
        raise ModelFormatError(f"config.json has invalid rope settings: {e}") from e
    max_position = _count(config_json, "max_position_embeddings", 2048)
    window = _sliding_window(config_json, model_type)
    if window is not None and window < max_position:
        # Within its window, sliding-window attention equals full attention, so capping the
        # context at the window runs the model exactly as trained instead of approximately.
        max_position = window

    try:
        return ModelConfig(
            architecture=family,
            vocab_size=config_json["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config_json["intermediate_size"],
            num_layers=config_json["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config_json.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(config_json, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position=max_position,
            tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
            attention_bias=bool(config_json.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            name=name,
        )
    except ValueError as e:
        raise ModelFormatError(f"config.json describes an invalid model: {e}") from e


def _count(config_json: dict[str, Any], key: str, default: Any = ...) -> Any:
    """A positive integer field (`default` when absent or null), else ModelFormatError: a
    string or a list where a count belongs would fail as a TypeError far from the cause."""
    value = config_json.get(key)
    if value is None and default is not ...:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFormatError(f"config.json: {key} must be a positive integer, "
                               f"got {json.dumps(value)[:60]}")
    return value


def _number(config_json: dict[str, Any], key: str, default: float) -> float:
    value = config_json.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(f"config.json: {key} must be a number, "
                               f"got {json.dumps(value)[:60]}")
    return float(value)


def _sliding_window(config_json: dict[str, Any], model_type: str) -> int | None:
    window = config_json.get("sliding_window")
    if model_type in SLIDING_WINDOW_FLAGGED and not config_json.get("use_sliding_window", False):
        return None
    return window if isinstance(window, int) and window > 0 else None


def _rope(config_json: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = config_json.get("rope_parameters")
    if params is None:
        params = config_json.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ValueError(f"rope_scaling must be an object, got {json.dumps(params)[:60]}")
        params = dict(params)
        params.setdefault("rope_theta", config_json.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {json.dumps(params)[:60]}")
    theta = float(params.get("rope_theta", config_json.get("rope_theta", 10000.0)))
    # transformers 4.x older checkpoints spell the key "type"; newer ones "rope_type".
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        try:
            return theta, RopeScaling(
                "llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ModelFormatError(f"llama3 rope scaling lacks {e.args[0]}") from e
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported "
                                "(supported: default, linear, llama3)")
