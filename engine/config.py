"""Configuration tree: small frozen dataclasses validated at construction.

Every `__post_init__` raises ValueError naming the bad field, so a bad flag or a bad model file
fails at start-up rather than in the middle of a forward pass. The environment is read only at
entry points (CLI, servers), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import inf


def _positive(obj: object, *names: str) -> None:
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
        _positive(self, "factor", "low_freq_factor", "high_freq_factor", "original_max_position")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-family decoder. Weight names follow Hugging Face's Llama naming."""

    architecture: str  # model family key in engine.models: "llama", "qwen2", "mistral"
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
    name: str = "model"

    def __post_init__(self) -> None:
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
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


# Element types of the paged KV cache. The attention kernels read either (queries stay fp32);
# bf16 halves the cache and the bytes of every KV transfer. Prefill and decode workers that
# exchange KV must use the same one (it is part of kvtransfer's KVLayout fingerprint).
KV_DTYPES = ("fp32", "bf16")
# The same names as kvtransfer.KVLayout.dtype spells them (torch's names).
KV_DTYPE_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def check_kv_dtype(value: object, name: str = "kv_dtype") -> str:
    """`value` if it is one of KV_DTYPES, else ValueError naming the choices."""
    if value not in KV_DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(KV_DTYPES)}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, for every layer, each
    element a `kv_dtype` (one of KV_DTYPES)."""

    block_size: int = 16
    num_blocks: int = 512
    enable_prefix_caching: bool = True
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _positive(self, "block_size", "num_blocks")
        check_kv_dtype(self.kv_dtype, "CacheConfig.kv_dtype")


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per forward pass: running decodes first (1 token each), then prefill
    chunks fill what is left. That single rule is chunked prefill and split-fuse."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Largest prefill chunk of one request in one pass; 0 means the whole budget.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "w8a8")
# Per-role choices offered to users: prefill is compute-bound (GEMM formats), decode is
# memory-bound (weight-only formats read fewer bytes per token).
PREFILL_FORMATS = ("fp32", "bf16", "w8a8")
DECODE_FORMATS = ("fp32", "bf16", "int8", "int4")
# What an engine does. A prefill worker computes prompts and sends their KV; a decode worker
# decodes (and prefills short prompts locally, split-fuse); a colocated engine does both in
# one process (`tandem run`, `tandem serve --colocated`, tests).
ENGINE_ROLES = ("prefill", "decode", "colocated")


def role_formats(role: str, decode_format: str, prefill_format: str | None) -> tuple[str, str | None]:
    """The weight formats an engine of `role` packs: (the format of every pass, a second
    format for prefill-only passes or None). A prefill engine holds only its prefill format
    (decode_format is not its business), a decode engine only its decode format; only a
    colocated engine may hold both, and only when they differ."""
    if role not in ENGINE_ROLES:
        raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
    if role == "prefill":
        return prefill_format or decode_format, None
    if role == "decode" or prefill_format in (None, decode_format):
        return decode_format, None
    return decode_format, prefill_format


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    role: str = "colocated"  # one of ENGINE_ROLES
    # Linear-layer weight formats (see kernels/linear.py); logits are always fp32.
    # weight_format: the format of every pass of this engine (a prefill engine's prefill
    # format, a decode engine's decode format). prefill_weight_format: colocated engines
    # only, a second copy used for passes without any decode token (engine/models/llama.py).
    weight_format: str = "fp32"
    prefill_weight_format: str | None = None  # None: weight_format for every pass
    max_model_len: int | None = None  # defaults to model.max_position

    def __post_init__(self) -> None:
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {self.role!r}")
        for name in ("weight_format", "prefill_weight_format"):
            value = getattr(self, name)
            if value is not None and value not in WEIGHT_FORMATS:
                raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {value!r}")
        if self.prefill_weight_format is not None and self.role != "colocated":
            raise ValueError(f"prefill_weight_format is for colocated engines only: a {self.role} "
                             f"engine runs every pass in weight_format")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def context_length(self) -> int:
        return min(self.max_model_len or self.model.max_position, self.model.max_position)
