"""A decode pass's decoder layers in one native call (kernels/csrc/decode_layers.cpp).

engine/models/llama.py's layer loop makes ~9 Python-level calls a layer (norms, projections,
RoPE and the KV write, attention, the SwiGLU gate), each wrapping a native kernel. For a small
model's decode step the wrapping costs about as much as the kernels: a 30-layer model of hidden
size 64 spent 3.9 ms a step in the loop on a Sapphire Rapids class core, about a third of
SmolLM2-135M's step at 2 threads. NativeDecode runs the same kernels with the same arguments in
the same order from C++, so a pass gives the same bits either way (tests/engine/
test_native_decode.py holds them equal), and the loop stays for every pass it does not take.

    native = NativeDecode.build(model)          # once, at load: None where a layer does not qualify
    out = native.run(batch, kv_cache, plan)     # per pass: (hidden, residual), or None to fall back

A model qualifies when every projection of its decode copy (LlamaForCausalLM.main) is in a
native CPU layout (int4 "q4_1"/"q4_1a8"/"q4_1x"/"q4_k"/"q4_ka8"/"q4_kx", int8 "native"/"q6_k"/"q6_kx"/"q8_0"/"q5_k", or a stack of
those; kernels/linear.py) with no K padding, its norms and RoPE tables are fp32 on the CPU, and
the native kernels load. A pass qualifies when every sequence in it is a one-token decode or a
speculative verification (its rows attended as decodes at their own positions, kernels/
attention.py; no prompt chunk), nothing listens for finished layers (a prefill worker's
KV transfer), the KV cache is fp32 or bf16, and the pass has fewer rows than the int8 layer's
dense cut-over (kernels/quant_int8.py NATIVE_DENSE_MIN_ROWS), where the Python path would leave
the native kernels (unless batch-invariant mode keeps them at every row count).
"""

from __future__ import annotations

import ctypes

import torch

from kernels import batch_invariance, native, quant_int4, quant_int8, quant_q5_k, quant_q6_k, quant_q8_0
from kernels.linear import PackedLinear

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

# kernels/csrc/decode_layers.cpp's kinds: (format, layout) -> kind
KINDS = {("int4", "q4_1"): 1, ("int4a8", "q4_1a8"): 2, ("int4", "q4_k"): 3, ("int4a8", "q4_ka8"): 4,
         ("int8", "native"): 5, ("int8", quant_q6_k.LAYOUT): 6, ("int8", quant_q8_0.LAYOUT): 7,
         ("int8", quant_q5_k.LAYOUT): 8, ("int4", quant_int4.AMX_LAYOUT): 9,
         ("int4", quant_int4.Q4_K_AMX_LAYOUT): 10, ("int8", quant_q6_k.AMX_LAYOUT): 11}
MAX_PARTS = 3


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("w", _ptr), ("a", _ptr), ("b", _ptr),
                ("c", _ptr), ("bias", _ptr)]


class _Proj(ctypes.Structure):
    _fields_ = [("nparts", _i64), ("parts", _Linear * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj)]


class _Args(ctypes.Structure):
    _fields_ = [("t", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64), ("inter", _i64),
                ("eps", _f32), ("scale", _f32), ("positions", _ptr), ("slot_mapping", _ptr),
                ("cos", _ptr), ("sin", _ptr), ("max_position", _i64), ("kv", _ptr), ("kv_bf16", _i64),
                ("num_blocks", _i64), ("block_size", _i64), ("rows32", _ptr), ("lens32", _ptr),
                ("table32", _ptr), ("table_stride", _i64), ("nseq", _i64)]


def _fp32_cpu(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _linear(p: PackedLinear) -> _Linear | None:
    """The kernel's view of one packed layer, as its Python wrapper calls it; None where the
    layer is not one the native decode path runs (another layout, padded K, a bias not fp32)."""
    kind = KINDS.get((p.fmt, p.layout))
    if kind is None or not _fp32_cpu(p.bias) or p.act_scale is not None:
        return None
    k = p.in_features
    if p.fmt in ("int4", "int4a8"):
        if p.weight.shape[1] * 2 != k:  # K padded to whole groups
            return None
        if p.layout in quant_int4.Q4_K_LAYOUTS + (quant_int4.Q4_K_AMX_LAYOUT,):
            arrays = (p.scales[0], p.scales[1], p.zeros)
        else:
            arrays = (p.scales, p.zeros, None)
    elif p.layout in quant_q6_k.LAYOUTS:
        arrays = (p.scales, p.zeros, None)
    elif p.layout == quant_q8_0.LAYOUT:
        arrays = (p.scales, None, None)
    elif p.layout == quant_q5_k.LAYOUT:
        arrays = (p.scales[0], p.scales[1], p.zeros)
    else:
        if p.weight.shape[1] != k or k % quant_int8.K_ALIGN:
            return None
        arrays = (p.scales, None, None)
    if any(a is not None and (a.device.type != "cpu" or not a.is_contiguous()) for a in (p.weight, *arrays)):
        return None
    ptr = native.ptr
    return _Linear(kind, p.out_features, k, p.weight.data_ptr(), *(ptr(a) for a in arrays), ptr(p.bias))


def _projection(p: PackedLinear) -> _Proj | None:
    parts = p.parts or (p,)
    lins = [_linear(q) for q in parts]
    if len(lins) > MAX_PARTS or any(lin is None for lin in lins):
        return None
    proj = _Proj(len(lins))
    for i, lin in enumerate(lins):
        proj.parts[i] = lin
    return proj


class NativeDecode:
    def __init__(self, model, layers: ctypes.Array) -> None:
        # The model owns this object and the tensors whose addresses `layers` holds; no
        # reference back to the model (no cycle), only the parts a pass reads.
        self.layers = layers
        self.config, self.scale, self.embed_tokens = model.config, model.scale, model.embed_tokens
        self.cos, self.sin = model.cos, model.sin

    @classmethod
    def build(cls, model) -> "NativeDecode | None":
        """None when the model's decode copy does not qualify (module docstring)."""
        cfg = model.config
        if (model.device.type != "cpu" or not native.available() or cfg.head_dim % 2
                or cfg.head_dim > 1024 or cfg.num_heads % cfg.num_kv_heads
                or not all(_fp32_cpu(t) for t in (model.cos, model.sin))):
            return None
        layers = (_Layer * cfg.num_layers)()
        for i, layer in enumerate(model.main.layers):
            norms = (layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm)
            projs = [_projection(p) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            if not all(_fp32_cpu(t) for t in norms) or any(p is None for p in projs):
                return None
            layers[i] = _Layer(*(native.ptr(t) for t in norms), *projs)
        return cls(model, layers)

    def run(self, batch, kv_cache: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the last layer, as the Python loop leaves them for the final
        norm; None when this pass does not qualify (the caller runs the loop)."""
        t = batch.num_tokens
        if (plan is None or plan.chunks or plan.decode is None or plan.decode.rows.shape[0] != t
                or batch.on_layer_done is not None
                or (t >= quant_int8.NATIVE_DENSE_MIN_ROWS and not batch_invariance.enabled())
                or kv_cache.dtype not in (torch.float32, torch.bfloat16) or kv_cache.device.type != "cpu"
                or not kv_cache.is_contiguous()):
            return None
        cfg, dp = self.config, plan.decode
        # The bounds paged_decode_native checks before its kernel, which reads what it is told.
        if (dp.max_row >= t or dp.max_block >= kv_cache.shape[2]
                or dp.max_len > dp.table32.shape[1] * kv_cache.shape[3]):
            raise ValueError(f"native decode: plan out of range (row {dp.max_row} of {t}, block "
                             f"{dp.max_block} of {kv_cache.shape[2]}, length {dp.max_len})")
        hidden = self.embed_tokens[batch.input_ids].float().contiguous()
        residual = torch.empty_like(hidden)
        positions, slots = batch.positions.contiguous(), batch.slot_mapping.contiguous()
        args = _Args(t, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                     cfg.rms_norm_eps, self.scale, positions.data_ptr(), slots.data_ptr(),
                     self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0], kv_cache.data_ptr(),
                     int(kv_cache.dtype == torch.bfloat16), kv_cache.shape[2], kv_cache.shape[3],
                     dp.rows32.data_ptr(), dp.lens32.data_ptr(), dp.table32.data_ptr(), dp.table32.stride(0),
                     dp.rows32.shape[0])
        native.check(native.library().tandem_decode_layers(
            ctypes.addressof(self.layers), cfg.num_layers, ctypes.byref(args), hidden.data_ptr(),
            residual.data_ptr()), "decode layers")
        return hidden, residual
