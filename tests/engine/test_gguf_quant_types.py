"""The GGUF quant types of the field: our dequantizers against gguf.quants (bit for bit), a
Q4_K_M-like mixed file against its dequantized F32 twin (logits equal), and refusals by name.

No llama.cpp quantizer is built here, so K-quant blocks are random bytes (every bit pattern of
the scales) or reliability/kquant_fixtures.py's round-to-nearest fit of a tiny model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from common.errors import UnsupportedModelError
from engine.loaders import load_model
from engine.model_runner import SequenceChunk
from engine.models import model_class
from kernels.ggml_dequant import BLOCKS, dequantize_rows
from kernels.linear import dequantize_packed
from kernels.quantized_tensor import QuantizedTensor
from reliability.kquant_fixtures import quantize_k, random_blocks
from reliability.model_factory import make_tiny_gguf
from tests.engine.test_loaders import _write_gguf
from tests.engine.test_model_forward import make_runner, run_chunks

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("ggml_type", sorted(BLOCKS))
def test_random_blocks_dequantize_exactly_as_gguf(ggml_type):
    data = random_blocks(ggml_type, rows=13, blocks_per_row=3, rng=np.random.default_rng(7))
    ours = dequantize_rows(ggml_type, data)
    expected = quants.dequantize(data, GGMLQuantizationType[ggml_type])
    assert ours.dtype == np.float32 and ours.shape == (13, 3 * BLOCKS[ggml_type][0])
    assert np.array_equal(_bits(ours), _bits(expected))


@pytest.mark.parametrize("ggml_type", sorted(BLOCKS))
def test_fitted_blocks_dequantize_exactly_as_gguf(ggml_type):
    w = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32) * 0.02
    qtype = GGMLQuantizationType[ggml_type]
    data = quantize_k(w, ggml_type) if ggml_type in K_QUANTS else quants.quantize(w, qtype)
    got = QuantizedTensor(ggml_type, data, w.shape).dequantize()
    expected = quants.dequantize(data, qtype)
    assert np.array_equal(_bits(got.numpy()), _bits(expected))
    # The fixture fit is a real quantization of w, not noise.
    assert np.abs(expected - w).max() < 0.1 * np.abs(w).max()


def test_dequantize_refuses_partial_blocks():
    with pytest.raises(ValueError, match="Q6_K rows of 200 bytes"):
        dequantize_rows("Q6_K", np.zeros((2, 200), np.uint8))


# --- a Q4_K_M-like file ------------------------------------------------------------------

SHAPE = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=2, vocab_size=320)
# llama.cpp's Q4_K_M: Q4_K matrices, Q6_K for the output (and the embeddings when tied) and
# for attn_v/ffn_down in some layers; Q5_K_M is the same with Q5_K. Q5_0 stands in for the
# fallback llama.cpp uses where a row is not a multiple of 256.
Q4_K_M = {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K",
          "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_k.weight": "Q5_0"}
MIXES = {
    "q4_k_m": ("Q4_K", Q4_K_M),
    "q4_k_m_tied": ("Q4_K", {"token_embd.weight": "Q6_K", **Q4_K_M}),
    "q5_k_m": ("Q5_K", {"output.weight": "Q6_K", "attn_v.weight": "Q6_K", "blk.1.ffn_up.weight": "Q5_1"}),
}


def _logits(loaded, fmt: str, ids: list[int]) -> torch.Tensor:
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, fmt)
    (logits,) = run_chunks(make_runner(model), [SequenceChunk(ids, 0, list(range(4)), True)])
    return logits


@pytest.fixture(scope="module", params=sorted(MIXES))
def mixed_pair(request, tmp_path_factory):
    """(quantized file, its F32 twin) of one mix, loaded."""
    base, types = MIXES[request.param]
    tie = request.param.endswith("_tied")
    tmp = tmp_path_factory.mktemp(request.param)
    kwargs = dict(SHAPE, tie=tie, seed=5, types=types)
    quantized = make_tiny_gguf(tmp / "q.gguf", base, **kwargs)
    twin = make_tiny_gguf(tmp / "f32.gguf", base, store_dequantized=True, **kwargs)
    return request.param, quantized, load_model(quantized.path), load_model(twin.path)


def test_mixed_file_keeps_each_matrix_in_its_type(mixed_pair):
    mix, _, loaded, _ = mixed_pair
    base, types = MIXES[mix]
    w = loaded.weights
    assert w["model.norm.weight"].dtype == torch.float32
    assert w["model.layers.1.mlp.gate_proj.weight"].ggml_type == base
    assert w["lm_head.weight"].ggml_type == "Q6_K"
    if mix.endswith("_tied"):
        assert w["lm_head.weight"] is w["model.embed_tokens.weight"]
    assert w["model.layers.0.self_attn.v_proj.weight"].ggml_type == "Q6_K"
    assert {t.ggml_type for t in w.values() if isinstance(t, QuantizedTensor)} == {base, *types.values()}


def test_mixed_file_logits_equal_its_f32_twin(mixed_pair):
    _, tiny, loaded, twin = mixed_pair
    for name, ref in twin.weights.items():  # Q/K un-permuted the same way in both files
        assert torch.equal(loaded.weights[name].dequantize() if isinstance(loaded.weights[name], QuantizedTensor)
                           else loaded.weights[name], ref), name
    ids = torch.randint(0, 320, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _logits(loaded, "fp32", ids)
    assert torch.equal(got, _logits(twin, "fp32", ids))
    # And the quantized model is still the model it was fitted from.
    with torch.no_grad():
        hf = tiny.model(torch.tensor([ids])).logits[0]
    assert torch.nn.functional.cosine_similarity(got, hf, dim=-1).min() > 0.95


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16", "w8a8"])
def test_mixed_file_packs_into_every_role_format(mixed_pair, fmt):
    _, _, loaded, _ = mixed_pair
    ids = list(range(3, 40))
    exact, got = _logits(loaded, "fp32", ids), _logits(loaded, fmt, ids)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got, exact, dim=-1).min() > 0.98


def test_int4_keeps_the_matrices_a_file_stores_wider_in_int8(mixed_pair):
    """engine/format_choice.py matrix_format: int4 repacks the 4-bit blocks as they are; Q5_*,
    Q6_K and Q8_0 matrices go int8, and each int8 matrix multiplies by weights within half an
    int8 step of the file's own. A fused projection whose parts differ in type (Q4_K_M's q|k|v
    beside a Q6_K v) is a stack of its parts, each in its own type's format
    (packs_parts_apart)."""
    mix, _, loaded, _ = mixed_pair
    base, types = MIXES[mix]
    model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, "int4")
    w = loaded.weights
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        parts = {"qkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                 "o_proj": [p + "self_attn.o_proj.weight"],
                 "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                 "down": [p + "mlp.down_proj.weight"]}
        for attr, names in parts.items():
            packed = getattr(layer, attr)
            kinds = ["int8" if w[n].ggml_type not in ("Q4_0", "Q4_1", "Q4_K") else "int4" for n in names]
            if len({w[n].ggml_type for n in names}) > 1:
                assert packed.fmt == "stack" and [q.fmt for q in packed.parts] == kinds, (mix, i, attr)
                assert torch.equal(dequantize_packed(packed), torch.cat([dequantize_packed(q) for q in packed.parts]))
            else:
                assert packed.fmt == kinds[0], (mix, i, attr)
            if attr == "down":
                exact, got = w[names[0]].dequantize(), dequantize_packed(packed)
                step = exact.abs().amax(dim=1, keepdim=True) / 127
                assert ((got - exact).abs() <= step / 2 + 1e-6).all()
    assert any(getattr(layer, a).fmt == "int8" for layer in model.layers for a in ("qkv", "down"))
    if mix.startswith("q4_k_m"):
        assert any(layer.qkv.fmt == "stack" for layer in model.layers)


# --- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", ["Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "TQ1_0"])
def test_unread_types_are_refused_by_name(tmp_path, ggml_type):
    qtype = GGMLQuantizationType[ggml_type]
    block, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    path = _write_gguf(tmp_path / "m.gguf", "llama", {
        "token_embd.weight": (np.zeros((8, 256 // block * block_bytes), np.uint8), qtype)})
    with pytest.raises(UnsupportedModelError) as e:
        load_model(path)
    message = str(e.value)
    assert f"token_embd.weight has ggml type {ggml_type}, which tandem does not read" in message
    for read in ("F16", "BF16", "Q4_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert read in message
