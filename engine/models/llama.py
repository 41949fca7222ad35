"""The LLaMA family (Llama 1-3, Mistral, SmolLM): RMSNorm, RoPE, GQA attention, SwiGLU.
Two options the config switches on, each a weight and one op: q/k/v biases
(ModelConfig.attention_bias, Qwen2) and per-head RMSNorm of q and k before RoPE
(ModelConfig.qk_norm, Qwen3).

Plain PyTorch over the ops in kernels/. Weights are packed once at load: q/k/v fused into one
projection and gate/up into another (one GEMM each instead of three and two). The residual
stream stays fp32; each linear casts to its weight format; logits are fp32. Every tensor of
the model lives on `device` (engine/device.py), packed there in that device's layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.model_config import ModelConfig
from common.errors import ModelFormatError
from engine.format_choice import matrix_format, packs_parts_apart, projection_weights
from engine.forward_batch import ForwardBatch
from engine.native_decode import NativeDecode
from engine.rope import rope_tables
from engine.token_embedding import TokenEmbedding
from engine.weights import QuantizedTensor, to_float
from kernels import batch_invariance
from kernels.activation import silu_and_mul
from kernels.attention import paged_attention, plan_paged_attention
from kernels.layout_choice import model_weights, prompt_passes
from kernels.linear import PackedLinear, linear, pack_linear, stack_linear
from kernels.rms_norm import rms_norm
from kernels.rotary_kv_write import rotary_kv_write


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
    q_norm: torch.Tensor | None = None  # [head_dim], with ModelConfig.qk_norm
    k_norm: torch.Tensor | None = None


# The lm_head reads the whole vocabulary every step; int8 halves bf16's bytes and keeps the
# logits (computed in fp32) close enough that greedy choices hold.
LM_HEAD_FORMAT = {"fp32": "fp32", "bf16": "bf16", "int8": "int8", "int4": "int8", "int4a8": "int8",
                  "w8a8": "int8"}


@dataclass
class FormatSet:
    """Every projection of the model, and its lm_head, packed in one weight format."""

    fmt: str
    layers: list[DecoderLayer]
    lm_head: PackedLinear


class LlamaForCausalLM:
    """Weight formats, one per role (DESIGN.md: prefill is compute-bound, decode memory-bound).

    `weight_format` packs every projection (and the lm_head, in LM_HEAD_FORMAT of it) once,
    and every pass runs in it. That is the whole story for a prefill worker (built with its
    prefill format) and for a decode worker (built with its decode format): the decode worker
    runs its local split-fuse prefill chunks in the decode format too, so what it computes for
    a request never depends on how many other requests share its batch or whether a prefill
    chunk rides along. Only a colocated engine (one process doing both phases) passes a
    distinct `prefill_format`, which packs a second copy; then the rule is by phase, never by
    size:

        a pass with no decode token at all (only prompt chunks)  -> the prefill copy
        a pass with any decode token                             -> the decode copy

    A decode token is a row feeding back a generated token (ForwardBatch.has_decode, set by
    the model runner). A copy is the projections and the lm_head together, so a colocated
    engine's prompt passes compute (and sample the first token) exactly as a prefill worker
    would, and its decode steps as a decode worker would; a prompt chunk that shares a pass
    with running decodes is computed in the decode format, as on a decode worker. No pass size
    switches formats: a 40-request decode batch stays in the decode format. (An earlier rule,
    "32+ tokens -> prefill copy", made a decode worker's outputs depend on how many requests
    shared its batch, and made every worker hold both copies.) The price: a decode worker's
    local prefill chunks run in a weight-only format, slower per token than a GEMM format;
    they are short by the coordinator's plan (local_chunk_size).
    """

    # ModelConfig flags a family's weights depend on; a subclass lists its own (Qwen2: biases).
    required_flags: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, weights: dict, weight_format: str = "fp32",
                 lm_head_format: str | None = None, prefill_format: str | None = None,
                 device: torch.device | str = "cpu", prompt_only: bool = False,
                 prompt_head_format: str | None = None) -> None:
        for flag in self.required_flags:
            if not getattr(config, flag):
                raise ValueError(f"{type(self).__name__} needs config.{flag} set: its checkpoints "
                                 "carry those weights")
        self.config = config
        self.device = device = torch.device(device)
        get = self._getter(weights)
        embed = get("model.embed_tokens.weight")
        self.norm = to_float(get("model.norm.weight")).to(device)
        tied = get("lm_head.weight") is weights.get("model.embed_tokens.weight")
        # prompt_head_format: the lm_head of a copy that runs prompt passes only (a prefill
        # worker's, a colocated engine's prefill copy), which multiplies one row per prompt, so
        # an exact head costs little there. engine/format_choice.py asks for fp32 beside a bf16
        # copy it picked for speed: on SmolLM2-135M the bf16 head alone turned "What is the
        # capital of France?" into "L'Étoile, la Marseillaise, ..." (bf16 layers with an fp32
        # head, and fp32, int4 and w8a8 copies, answer "The capital of France is Paris.").
        def head_format(fmt: str, prompt: bool) -> str:
            if lm_head_format:
                return lm_head_format
            return prompt_head_format if prompt and prompt_head_format else LM_HEAD_FORMAT[fmt]

        copies = [(weight_format, prompt_only)] + ([(prefill_format, True)] if prefill_format is not None else [])
        # A tied fp32 lm_head and the embedding share one fp32 table; else the embedding stays
        # as the file stores it (engine/token_embedding.py).
        shared = (to_float(embed).to(device) if tied and "fp32" in
                  {head_format(f, prompt) for f, prompt in copies} else None)
        self.embed_tokens = TokenEmbedding(embed, device, fp32_table=shared)
        heads: dict[str, PackedLinear] = {}

        def format_set(fmt: str, prompt: bool) -> FormatSet:
            head_fmt = head_format(fmt, prompt)
            if head_fmt not in heads:
                if head_fmt == "fp32" and tied:
                    heads[head_fmt] = PackedLinear("fp32", config.hidden_size, config.vocab_size, shared)
                else:
                    heads[head_fmt] = pack_linear(get("lm_head.weight"), None, head_fmt, device=device)
            return FormatSet(fmt, [self._load_layer(get, i, fmt) for i in range(config.num_layers)],
                             heads[head_fmt])

        # The layers' weights in all: where they outgrow the CPU's cache, a decode step streams
        # them from memory, and the faster kernel layout can differ (kernels/layout_choice.py).
        # prompt_only: the main copy runs prompt passes only (a prefill worker's), as a second
        # copy always does; their layouts are those made for many rows (layout_choice.prompt_passes).
        with model_weights(projection_weights(weights)):
            with prompt_passes(prompt_only):
                self.main = format_set(weight_format, prompt_only)
            # A second copy only for a distinct prefill format (colocated engines).
            with prompt_passes():
                self.prefill_copy = (format_set(prefill_format, True) if prefill_format is not None
                                     and prefill_format != weight_format else None)
        cos, sin = rope_tables(config.head_dim, config.max_position, config.rope_theta,
                               config.rope_scaling)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.scale = config.head_dim ** -0.5
        # Decode passes through one native call where the decode copy's layers allow it
        # (engine/native_decode.py): the same kernels and bits as the loop in forward().
        self.native_decode = NativeDecode.build(self)

    @property
    def weight_format(self) -> str:
        """The format of every pass (of every pass with a decode token, when a colocated
        engine holds a prefill copy too)."""
        return self.main.fmt

    @property
    def prefill_format(self) -> str:
        """The format of passes without decode tokens."""
        return (self.prefill_copy or self.main).fmt

    @property
    def formats(self) -> tuple[str, ...]:
        """Every weight format this model holds a copy of."""
        return (self.main.fmt,) if self.prefill_copy is None else (self.main.fmt, self.prefill_copy.fmt)

    @property
    def layers(self) -> list[DecoderLayer]:
        """The main copy's layers (the only ones unless prefill_copy is set)."""
        return self.main.layers

    @property
    def lm_head(self) -> PackedLinear:
        return self.main.lm_head

    def weights_for(self, batch: ForwardBatch | None) -> FormatSet:
        """The copy a pass runs in (see the class docstring). A batch that does not say
        whether it holds decode tokens (has_decode None, e.g. built by hand) counts a
        one-token sequence as one."""
        if self.prefill_copy is None or batch is None or batch_invariance.enabled():
            return self.main  # the mode: one copy, whatever the pass holds (engine/llm_engine.py)
        has_decode = batch.has_decode
        if has_decode is None:
            has_decode = bool(((batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]) == 1).any())
        return self.main if has_decode else self.prefill_copy

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
        dev = self.device

        def pack(parts: list, bias: torch.Tensor | None = None) -> PackedLinear:
            if packs_parts_apart(fmt, parts):  # each part keeps the layout that reads it exactly
                biases = bias.split([p.shape[0] for p in parts]) if bias is not None else [None] * len(parts)
                return stack_linear([pack_linear(p, b, matrix_format(fmt, [p]), device=dev)
                                     for p, b in zip(parts, biases)])
            return pack_linear(concat_rows(parts), bias, matrix_format(fmt, parts), device=dev)

        qkv_bias = None
        if self.config.attention_bias:
            qkv_bias = torch.cat([to_float(get(p + f"self_attn.{n}_proj.bias")) for n in "qkv"])
        qk_norms = {}
        if self.config.qk_norm:
            qk_norms = {f"{n}_norm": to_float(get(p + f"self_attn.{n}_norm.weight")).to(dev) for n in "qk"}
        return DecoderLayer(
            input_norm=to_float(get(p + "input_layernorm.weight")).to(dev),
            qkv=pack([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], qkv_bias),
            o_proj=pack([get(p + "self_attn.o_proj.weight")]),
            post_attention_norm=to_float(get(p + "post_attention_layernorm.weight")).to(dev),
            gate_up=pack([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            down=pack([get(p + "mlp.down_proj.weight")]),
            **qk_norms,
        )

    def _norm_qk(self, qkv: torch.Tensor, layer: DecoderLayer) -> torch.Tensor:
        """qkv [T, q + 2 kv] with each q and k head RMS-normed over head_dim (Qwen3)."""
        cfg = self.config
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, _ = rms_norm(q.reshape(-1, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps)
        k, _ = rms_norm(k.reshape(-1, cfg.head_dim), layer.k_norm, cfg.rms_norm_eps)
        t = qkv.shape[0]
        return torch.cat([q.reshape(t, cfg.q_size), k.reshape(t, cfg.kv_size), v], dim=-1)

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns the final hidden states [T, hidden] (fp32)."""
        cfg = self.config
        t = batch.num_tokens
        plan = plan_paged_attention(batch.cu_seqlens_q, batch.seq_lens, batch.block_tables, kv_cache.shape[3],
                                    batch.rows_as_decodes)
        weights = self.weights_for(batch)
        done = (self.native_decode.run(batch, kv_cache, plan)
                if self.native_decode is not None and weights is self.main else None)
        if done is not None:
            hidden, residual = done
            hidden, _ = rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
            return hidden
        hidden = self.embed_tokens[batch.input_ids]
        residual = None
        for i, layer in enumerate(weights.layers):
            x, residual = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            qkv = linear(x, layer.qkv)
            if layer.q_norm is not None:
                qkv = self._norm_qk(qkv, layer)
            q = rotary_kv_write(qkv, batch.positions, self.cos, self.sin, k_cache,
                                v_cache, batch.slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            if batch.on_layer_done is not None:
                batch.on_layer_done(i)
            attn = paged_attention(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                   batch.block_tables, self.scale, plan)
            hidden = linear(attn.reshape(t, cfg.q_size), layer.o_proj)
            x, residual = rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps, residual)
            hidden = linear(silu_and_mul(linear(x, layer.gate_up)), layer.down)
        hidden, _ = rms_norm(hidden, self.norm, cfg.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        """hidden: [S, hidden] -> fp32 logits [S, vocab], with the lm_head of the copy the
        pass `batch` ran in (the main copy when not given)."""
        return linear(hidden, self.weights_for(batch).lm_head).float()
