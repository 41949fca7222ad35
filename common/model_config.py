"""A model's shape, as read from its files: the one config the coordinator, the launchers and
the engine all need. Frozen; `__post_init__` raises ValueError naming the bad field, so a bad
model file fails at load rather than in the middle of a forward pass. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

from common.pooling import Pooling


def positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        # `not 0 < value < inf` rather than `value <= 0`: NaN compares false to everything,
        # and a NaN or infinite rope_theta read from a corrupt file would pass the latter.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < inf:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: 'linear' (divide positions by factor) or 'llama3'
    (Llama-3.1's piecewise rescaling of low frequencies)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r} (supported: linear, llama3)")
        positive(self, "factor", "low_freq_factor", "high_freq_factor", "original_max_position")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-family decoder. Weight names follow Hugging Face's Llama naming."""

    architecture: str  # model family key in engine.models: "llama", "qwen2", "qwen3", "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position: int = 2048  # the model's context length
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm (weights [head_dim]) on q and k before RoPE
    name: str = "model"
    # The embedding routes' default pooling: the one the model file names (GGUF
    # `<arch>.pooling_type` "last" for embedders trained on the last token: Qwen3-Embedding,
    # e5-mistral), else mean (engine/embedding.py). A request's `pooling` overrides it.
    pooling: Pooling = Pooling.MEAN

    def __post_init__(self) -> None:
        positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "max_position")
        # A model file may say 32.0 or "32" where a count belongs; a float count would make
        # every weight shape a float and every loop over layers a TypeError much later.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ModelConfig.{name} must be an integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
