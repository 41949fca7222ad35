"""The whole forward pass through the Triton dispatch path, against the torch reference.

Under TRITON_INTERPRET=1 (tests/conftest.py) `kernel_path("triton")` makes every dispatcher
take its Triton launcher on CPU tensors, and layers pack in the Triton layouts. Each pass is
compared with `reference_forward`: the same packed weights through each op's plain-torch
reference (kernels/*_reference), with its own copy of the KV cache. kernels._triton.launches
proves that every kernel ran in place, as many times per pass as the model has layers.

Precision: fp32 activations and KV (the interpreter computes bf16 dots wrongly; on a GPU the
weight-only GEMMs take bf16 activations, kernels/_triton.py activation_dtype).

The default model (SmolLM2-135M Q4_1 -> int4 "nibbles" layers, int8 lm_head) runs all 30 of
its layers, the real weights and vocabulary, for an 8-token prompt and one decode step (the
whole model under the interpreter takes large GEMM tiles: kernels/_triton.py gemm_tiles); the
tiny model covers every weight format, ragged batches and the split decode path.
"""

from __future__ import annotations


import pytest
import torch

import kernels.paged_attention as paged_attention_module
from engine.config import CacheConfig
from engine.loaders import load_model
from common.hf_config import hf_model_config
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from kernels import _triton
from kernels.activation import silu_and_mul_reference
from kernels.attention import paged_attention_reference
from kernels.linear import packed_linear_reference
from kernels.rms_norm import rms_norm_reference
from kernels.rotary_kv_write import rotary_kv_write_reference
from reliability.model_factory import build_tiny_hf

PER_LAYER = ("rotary", "kv_cache_write", "silu_and_mul")
GEMMS = {  # weight format -> {kernel: launches per layer}; the lm_head adds one GEMM per pass
    "fp32": {},
    "int8": {"int8_gemm": 4},
    "int4": {"int4_gemm": 4},
    "w8a8": {"quantize_per_token": 4, "w8a8_gemm": 4},
}
LM_HEAD_KERNEL = {"fp32": None, "int8": "int8_gemm", "int4": "int8_gemm", "w8a8": "int8_gemm"}


def reference_forward(model, batch, kv_cache: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM.forward + compute_logits with every op's torch reference."""
    cfg = model.config
    copy = model.weights_for(batch)
    hidden, residual = model.embed_tokens[batch.input_ids], None
    for i, layer in enumerate(copy.layers):
        x, residual = rms_norm_reference(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        q = rotary_kv_write_reference(packed_linear_reference(x, layer.qkv), batch.positions, model.cos,
                                      model.sin, k_cache, v_cache, batch.slot_mapping, cfg.num_heads,
                                      cfg.num_kv_heads, cfg.head_dim)
        attn = paged_attention_reference(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                         batch.block_tables, model.scale)
        hidden = packed_linear_reference(attn.reshape(batch.num_tokens, cfg.q_size), layer.o_proj)
        x, residual = rms_norm_reference(hidden, layer.post_attention_norm, cfg.rms_norm_eps, residual)
        hidden = packed_linear_reference(silu_and_mul_reference(packed_linear_reference(x, layer.gate_up)),
                                         layer.down)
    hidden, _ = rms_norm_reference(hidden, model.norm, cfg.rms_norm_eps, residual)
    return packed_linear_reference(hidden[batch.logits_indices], copy.lm_head).float()


class Pair:
    """A runner on the Triton path and a reference KV cache, stepped together."""

    def __init__(self, model, cache: CacheConfig) -> None:
        self.model = model
        self.runner = ModelRunner(model, cache, cuda_graphs=False)
        self.ref_cache = self.runner.kv_cache.clone()

    def step(self, chunks: list[SequenceChunk]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        _triton.launches.clear()
        with torch.inference_mode():
            logits = self.runner.execute(chunks)
            launched = dict(_triton.launches)
            ref = reference_forward(self.model, self.runner.prepare(chunks), self.ref_cache)
        return logits, ref, launched


def expected_launches(fmt: str, num_layers: int, attention: str) -> dict[str, int]:
    want = {"rms_norm": 2 * num_layers + 1, attention: num_layers}
    want.update({name: num_layers for name in PER_LAYER})
    want.update({name: n * num_layers for name, n in GEMMS[fmt].items()})
    if LM_HEAD_KERNEL[fmt]:
        want[LM_HEAD_KERNEL[fmt]] = want.get(LM_HEAD_KERNEL[fmt], 0) + 1
    return want


def assert_close(logits: torch.Tensor, ref: torch.Tensor) -> None:
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    scale = float(ref.abs().max())
    torch.testing.assert_close(logits, ref, rtol=0, atol=2e-4 * max(1.0, scale))
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def tiny():
    hf = build_tiny_hf("llama", vocab_size=160, hidden=64, layers=2, heads=4, kv_heads=2,
                       intermediate=96, seed=3)
    return hf_model_config(hf.config.to_dict()), dict(hf.state_dict())


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4", "w8a8"])
def test_tiny_llama_through_every_triton_kernel(tiny, fmt, monkeypatch):
    config, weights = tiny
    with _triton.kernel_path("triton"):
        model = model_class("llama")(config, weights, fmt)
        pair = Pair(model, CacheConfig(block_size=4, num_blocks=16))
        layers = config.num_layers
        # A ragged prompt pass (FlashAttention): a fresh 7-token prompt, and a 5-token one.
        a, b = [3, 17, 42, 9, 77, 5, 101], [11, 12, 13, 14, 15]
        chunks = [SequenceChunk(a, 0, [2, 5], True), SequenceChunk(b[:3], 0, [7], False)]
        logits, ref, launched = pair.step(chunks)
        assert_close(logits, ref)
        assert launched == expected_launches(fmt, layers, "flash_attention")
        # b's second chunk continues its cached prefix, beside a's first decode: still one
        # FlashAttention launch (T != B), mixed lengths.
        chunks = [SequenceChunk([int(logits[0].argmax())], 7, [2, 5], True, is_decode=True),
                  SequenceChunk(b[3:], 3, [7, 8], True)]
        logits, ref, launched = pair.step(chunks)
        assert_close(logits, ref)
        assert launched == expected_launches(fmt, layers, "flash_attention")
        # Pure decode steps (T == B): the paged decode kernel, then its split-K form with the
        # merge kernel, which a GPU takes for long contexts with few sequences.
        tokens = logits.argmax(-1).tolist()
        chunks = [SequenceChunk([tokens[0]], 8, [2, 5, 9], True, is_decode=True),
                  SequenceChunk([tokens[1]], 5, [7, 8], True, is_decode=True)]
        logits, ref, launched = pair.step(chunks)
        assert_close(logits, ref)
        assert launched == expected_launches(fmt, layers, "paged_decode")
        monkeypatch.setattr(paged_attention_module, "choose_num_splits", lambda *args: 2)
        tokens = logits.argmax(-1).tolist()
        chunks = [SequenceChunk([tokens[0]], 9, [2, 5, 9], True, is_decode=True),
                  SequenceChunk([tokens[1]], 6, [7, 8], True, is_decode=True)]
        logits, ref, launched = pair.step(chunks)
        assert_close(logits, ref)
        assert launched == {**expected_launches(fmt, layers, "paged_decode"), "merge_splits": layers}
    # Every written slot holds what the reference wrote (the KV write kernel, in place).
    torch.testing.assert_close(pair.runner.kv_cache, pair.ref_cache, rtol=0, atol=1e-5)
    assert pair.runner.kv_cache.abs().sum() > 0


def test_default_path_on_cpu_launches_no_triton_kernel(tiny):
    config, weights = tiny
    assert _triton.current_kernel_path() == "auto"
    model = model_class("llama")(config, weights, "int4")
    assert model.layers[0].qkv.layout != "nibbles"  # packed for the CPU kernels
    pair = Pair(model, CacheConfig(block_size=4, num_blocks=8))
    logits, ref, launched = pair.step([SequenceChunk([1, 2, 3, 4, 5], 0, [1, 2], True)])
    assert launched == {}
    assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_default_model_through_the_triton_path(default_gguf):
    loaded = load_model(default_gguf)
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].ggml_type == "Q4_1"
    config = loaded.config
    with _triton.kernel_path("triton"):
        model = model_class(config.architecture)(config, loaded.weights, "int4")
        assert model.layers[0].qkv.layout == "nibbles" and model.lm_head.layout == "triton"
        pair = Pair(model, CacheConfig(block_size=16, num_blocks=4))
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646]  # 8 tokens of the vocabulary
        logits, ref, launched = pair.step([SequenceChunk(prompt, 0, [3], True)])
        assert_close(logits, ref)
        assert launched == expected_launches("int4", config.num_layers, "flash_attention")
        for pos in (8,):
            token = int(logits[0].argmax())
            logits, ref, launched = pair.step([SequenceChunk([token], pos, [3], True, is_decode=True)])
            assert_close(logits, ref)
            assert launched == expected_launches("int4", config.num_layers, "paged_decode")
    torch.testing.assert_close(pair.runner.kv_cache, pair.ref_cache, rtol=0, atol=1e-4)


def test_kernel_path_is_validated_and_restored():
    with pytest.raises(ValueError, match="TANDEM_KERNELS must be one of"):
        _triton.check_kernel_path("gpu")
    before = _triton.current_kernel_path()
    with pytest.raises(RuntimeError):
        with _triton.kernel_path("torch"):
            assert not _triton.use_triton(torch.zeros(1))
            raise RuntimeError("leaves the block")
    assert _triton.current_kernel_path() == before
    with _triton.kernel_path("triton"):
        assert _triton.use_triton(torch.zeros(1)) and _triton.triton_layouts(torch.device("cpu"))
