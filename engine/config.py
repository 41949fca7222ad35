"""Configuration tree: small frozen dataclasses validated at construction.

Every `__post_init__` raises ValueError naming the bad field, so a bad flag or a bad model file
fails at start-up rather than in the middle of a forward pass. The environment is read only at
entry points (CLI, servers), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.format_choice import AUTO_FORMAT
from common.model_config import ModelConfig, positive
from engine.device import check_device_spec
from engine.speculative_config import SpeculativeConfig

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


DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, for every layer, each
    element a `kv_dtype` (one of KV_DTYPES). num_blocks None: as many as `kv_cache_bytes`
    holds, counted by LLMEngine.from_path once the model's geometry is known."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES  # sizes the pool only when num_blocks is None
    enable_prefix_caching: bool = True
    kv_dtype: str = "fp32"

    def __post_init__(self) -> None:
        positive(self, "block_size", "kv_cache_bytes")
        if self.num_blocks is not None:
            positive(self, "num_blocks")
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
        positive(self, "max_num_batched_tokens", "max_num_seqs")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")


WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "int4a8", "w8a8")
# Per-role choices offered to users: prefill is compute-bound (GEMM formats), decode is
# memory-bound (weight-only formats read fewer bytes per token).
# "auto" (the default): chosen by the model's size against the host's memory when the model is
# read (engine/format_choice.py).
PREFILL_FORMATS = ("auto", "fp32", "bf16", "w8a8", "int4")
DECODE_FORMATS = ("fp32", "bf16", "int8", "int4", "int4a8")
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
    """What one engine is. `model` None: read from the model's files by LLMEngine.from_path,
    which also sizes cache.num_blocks when that is None; LLMEngine itself takes a config with
    both known."""

    model: ModelConfig | None = None
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
    # Where the weights, the KV cache and sampling go (engine/device.py: cpu, cuda, cuda:N,
    # auto), resolved when the model loads; cuda_graphs: replay decode steps as CUDA graphs
    # there (CUDA only, engine/cuda_graphs.py).
    device: str = "cpu"
    cuda_graphs: bool = True
    # Speculative decoding (engine/speculative_config.py); None = off. Decode and colocated
    # engines only: a prefill engine samples one token per request, nothing to speculate on.
    speculative: SpeculativeConfig | None = None

    @classmethod
    def for_role(cls, role: str, decode_format: str, prefill_format: str | None = None,
                 **fields) -> EngineConfig:
        """An engine of `role` given the two formats a user picks (--decode-quant,
        --prefill-quant): it holds only those role_formats keeps for that role."""
        main, second = role_formats(role, decode_format, prefill_format)
        return cls(role=role, weight_format=main, prefill_weight_format=second, **fields)

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {self.role!r}")
        for name in ("weight_format", "prefill_weight_format"):
            value = getattr(self, name)
            # "auto" only for a prefill format, until LLMEngine.from_path resolves it.
            auto_ok = value == AUTO_FORMAT and self.model is None and (
                name == "prefill_weight_format" or self.role == "prefill")
            if value is not None and value not in WEIGHT_FORMATS and not auto_ok:
                raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {value!r}")
        if self.prefill_weight_format is not None and self.role != "colocated":
            raise ValueError(f"prefill_weight_format is for colocated engines only: a {self.role} "
                             f"engine runs every pass in weight_format")
        if self.speculative is not None and self.role == "prefill":
            raise ValueError("speculative decoding is for decode and colocated engines; a "
                             "prefill engine samples only each request's first token")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def context_length(self) -> int:
        return min(self.max_model_len or self.model.max_position, self.model.max_position)
