"""The prefill format `auto` stands for (engine/format_choice.py): by the model's matrices
against the host's memory, resolved when the model is read, logged, and what the engine packs."""

from __future__ import annotations

import logging

import pytest

from common.model_config import ModelConfig
from engine import format_choice
from engine.config import CacheConfig, EngineConfig
from engine.format_choice import AUTO_FORMAT, choose_prefill_format, matrix_params
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_hf_model
from worker.config import DEFAULT_PREFILL_QUANT

GIB = 1 << 30


def shape(hidden, ffn, layers, heads, kv_heads, vocab) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=ffn, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=hidden // heads)


SMOLLM2_135M = shape(576, 1536, 30, 9, 3, 49152)
TINYLLAMA_1B = shape(2048, 5632, 22, 32, 4, 32000)
LLAMA3_8B = shape(4096, 14336, 32, 32, 8, 128256)


def test_matrix_params_of_known_shapes():
    assert matrix_params(SMOLLM2_135M) == 30 * (576 * (576 + 2 * 192) + 576 * 576
                                                + 3 * 576 * 1536) + 49152 * 576
    assert round(matrix_params(LLAMA3_8B) / 1e9, 2) == 7.5  # the 8B without its embedding table


def test_each_model_size_gets_the_format_that_fits_24_gib():
    mem = 24 * GIB
    assert choose_prefill_format(SMOLLM2_135M, mem).format == "fp32"
    assert choose_prefill_format(TINYLLAMA_1B, mem).format == "bf16"
    choice = choose_prefill_format(LLAMA3_8B, mem)
    assert choice.format == "w8a8" and "1/3 of 24.0 GiB" in choice.reason and choice.fits
    # A host where even w8a8 beside the int4 decode copy is too much: still w8a8 (nothing
    # smaller exists for prefill), marked as not fitting, with the figures.
    small = choose_prefill_format(LLAMA3_8B, 12 * GIB)
    assert small.format == "w8a8" and not small.fits and "too small" in small.reason
    # An 8B in w8a8 (~7.5 GB) beside its int4 decode copy (~4 GB) leaves room for KV pools.
    assert matrix_params(LLAMA3_8B) * (1 + 0.5625) < 16 * GIB
    # A larger host keeps the exact format longer.
    assert choose_prefill_format(TINYLLAMA_1B, 256 * GIB).format == "fp32"
    with pytest.raises(ValueError, match="positive"):
        choose_prefill_format(SMOLLM2_135M, 0)


@pytest.fixture
def bf16_not_faster(monkeypatch):
    """The engine's bf16 measurement answers no, so the memory rule alone decides (the host's
    own answer is tested below)."""
    monkeypatch.setattr(format_choice, "bf16_prefill_faster", lambda: False)


def test_auto_is_the_default_and_the_engine_resolves_it(tmp_path, caplog, bf16_not_faster):
    assert DEFAULT_PREFILL_QUANT == AUTO_FORMAT
    model_dir = make_tiny_hf_model(tmp_path / "m", "llama")
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        engine = LLMEngine.from_path(model_dir, EngineConfig.for_role(
            "prefill", "int4", AUTO_FORMAT, cache=CacheConfig(num_blocks=8)))
    assert engine.config.weight_format == "fp32" and engine.model.formats == ("fp32",)
    assert "prefill weight format auto: fp32" in caplog.text
    colocated = LLMEngine.from_path(model_dir, EngineConfig.for_role(
        "colocated", "int8", AUTO_FORMAT, cache=CacheConfig(num_blocks=8)))
    assert colocated.config.prefill_weight_format == "fp32"
    assert colocated.model.formats == ("int8", "fp32")
    with pytest.raises(ValueError, match="weight_format must be one of"):
        EngineConfig(role="decode", weight_format=AUTO_FORMAT)  # decode formats are never auto


def test_int4_first_where_the_tiles_run_and_the_file_holds_int4_blocks(tmp_path, monkeypatch, caplog,
                                                                      bf16_not_faster):
    """Where int4 runs on AMX tiles and every projection is a block int4 holds as stored, auto is
    int4 in fp32's place; bf16 and w8a8, faster than the tiles at prompt sizes, stand, and so
    does the memory rule elsewhere."""
    from kernels import native
    from reliability.model_factory import make_tiny_gguf

    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, int4_tiles=True).format == "int4"
    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, int4_tiles=False).format == "fp32"
    assert choose_prefill_format(TINYLLAMA_1B, 24 * GIB, int4_tiles=True).format == "bf16"
    assert choose_prefill_format(LLAMA3_8B, 24 * GIB, int4_tiles=True).format == "w8a8"
    q4 = make_tiny_gguf(tmp_path / "q4.gguf", "Q4_1").path
    f32 = make_tiny_gguf(tmp_path / "f32.gguf", "F32").path
    for granted, path, want in ((True, q4, "int4"), (False, q4, "fp32"), (True, f32, "fp32")):
        monkeypatch.setattr(native, "amx_available", lambda level=None, g=granted: g)
        with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
            engine = LLMEngine.from_path(path, EngineConfig.for_role(
                "prefill", "int4", AUTO_FORMAT, cache=CacheConfig(num_blocks=8)), load_tokenizer=False)
        assert engine.config.weight_format == want, (granted, path)
        assert f"prefill weight format auto: {want}" in caplog.text


def test_q6_k_projections_count_as_int4_holds_them_in_tiles():
    """A Q4_K_M file keeps attn_v and half of ffn_down in Q6_K: a prompt-pass copy holds them
    as stored in the "q6_kx" tile layout, so they count beside 4-bit blocks; a type int4 does
    not hold as stored does not."""
    from engine.format_choice import int4_native_projections
    from tests.kernels.test_native_kquant import kquant

    weights = {"model.layers.0.self_attn.q_proj.weight": kquant("Q4_K", 32, 256, seed=0),
               "model.layers.0.self_attn.v_proj.weight": kquant("Q6_K", 16, 256, seed=1)}
    assert int4_native_projections(weights)
    weights["model.layers.0.mlp.down_proj.weight"] = kquant("Q5_K", 16, 256, seed=3)
    assert not int4_native_projections(weights)
    assert not int4_native_projections({"lm_head.weight": kquant("Q6_K", 16, 256, seed=1)})  # no layers


def test_a_prefill_worker_packs_the_tile_layouts_without_measuring(tmp_path, monkeypatch):
    """The prefill role's copy runs prompt passes only: where AMX tiles are granted its int4 and
    Q6_K matrices take the tile layouts, whatever the decode-size choice says; a decode
    engine's copy keeps that choice."""
    from kernels import layout_choice, native, quant_int4, quant_q6_k
    from reliability.model_factory import make_tiny_gguf

    monkeypatch.setattr(native, "amx_available", lambda level=None: True)
    monkeypatch.setattr(layout_choice, "fastest_layout", lambda fmt, candidates, *a, **kw: candidates[0])
    path = make_tiny_gguf(tmp_path / "q4_k_m.gguf", "Q4_K", hidden=256, intermediate=512, heads=4, kv_heads=2,
                          layers=2, vocab_size=320, types={"attn_v.weight": "Q6_K"}).path
    layouts = {}
    for role in ("prefill", "decode"):
        engine = LLMEngine.from_path(path, EngineConfig.for_role(role, "int4", "int4",
                                                                cache=CacheConfig(num_blocks=8)),
                                     load_tokenizer=False)
        layer = engine.model.main.layers[0]
        layouts[role] = (layer.gate_up.layout, layer.qkv.parts[-1].layout)
    assert layouts["prefill"] == (quant_int4.Q4_K_AMX_LAYOUT, quant_q6_k.AMX_LAYOUT)
    assert layouts["decode"] == ("q4_k", "q6_k")  # the (patched) measured choice: its first candidate


def test_bf16_takes_fp32_s_place_only_where_it_measured_faster(tmp_path, caplog, monkeypatch):
    """bf16 in fp32's place where this host's bf16 GEMM is BF16_MIN_GAIN times as fast; the
    question is asked only where fp32 would be chosen and the tiles do not take its place."""
    asked = []

    def faster(answer):
        return lambda: asked.append(answer) or answer

    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, bf16_faster=faster(True)).format == "bf16"
    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, bf16_faster=faster(False)).format == "fp32"
    assert asked == [True, False]
    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, int4_tiles=True, bf16_faster=faster(True)).format == "int4"
    assert choose_prefill_format(TINYLLAMA_1B, 24 * GIB, bf16_faster=faster(True)).format == "bf16"
    assert choose_prefill_format(LLAMA3_8B, 24 * GIB, bf16_faster=faster(True)).format == "w8a8"
    assert asked == [True, False]  # the tiles, and the memory rule, decided without asking
    monkeypatch.setattr(format_choice, "bf16_prefill_faster", lambda: True)
    model_dir = make_tiny_hf_model(tmp_path / "m", "llama")
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        engine = LLMEngine.from_path(model_dir, EngineConfig.for_role(
            "prefill", "int4", AUTO_FORMAT, cache=CacheConfig(num_blocks=8)))
    assert engine.config.weight_format == "bf16" and engine.model.formats == ("bf16",)
    assert "prefill weight format auto: bf16" in caplog.text and "bf16 GEMM measured" in caplog.text
    assert engine.model.main.lm_head.fmt == "fp32"  # the prompt copy's head stays exact
    colocated = LLMEngine.from_path(model_dir, EngineConfig.for_role(
        "colocated", "int4", AUTO_FORMAT, cache=CacheConfig(num_blocks=8)))
    assert colocated.model.formats == ("int4", "bf16")
    assert colocated.model.prefill_copy.lm_head.fmt == "fp32" and colocated.model.main.lm_head.fmt == "int8"
    # Chosen by memory (a 1B on this host), bf16 keeps its own head: the model's format rules.
    assert choose_prefill_format(TINYLLAMA_1B, 24 * GIB).prompt_head is None
    assert choose_prefill_format(SMOLLM2_135M, 24 * GIB, bf16_faster=lambda: True).prompt_head == "fp32"


@pytest.mark.model
def test_bf16_prompt_passes_answer_the_default_model_s_question_right(default_gguf, monkeypatch):
    """The reason the head stays fp32: a bf16 head turned this answer into "L'Étoile, la
    Marseillaise, ..." on the default model; with bf16 layers and an fp32 head the first tokens
    are fp32's. Where the host grants AMX tiles, auto would take int4 for this Q4_1 file
    instead (one copy, no bf16 to test), so the tiles are ruled out as well as bf16 measured."""
    from tests.nodes.test_disaggregation import expected_text

    monkeypatch.setattr(format_choice, "bf16_prefill_faster", lambda: True)
    monkeypatch.setattr(format_choice, "int4_native_projections", lambda weights: False)
    engine = LLMEngine.from_path(default_gguf, EngineConfig.for_role(
        "colocated", "int4", AUTO_FORMAT, cache=CacheConfig(num_blocks=64)))
    assert engine.model.formats == ("int4", "bf16")
    assert expected_text(engine, "What is the capital of France?", 8).startswith("The capital of France is Paris")


@pytest.mark.parametrize("bf16_seconds,want", [(0.6, True), (0.7, False)])
def test_bf16_prefill_faster_needs_the_minimum_gain_and_is_measured_once(tmp_path, monkeypatch,
                                                                         bf16_seconds, want):
    from kernels import layout_choice

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setattr(layout_choice, "_memo", {})
    timed = []

    def fake(fmt, reps=3):
        timed.append(fmt)
        return {"fp32": 1.0, "bf16": bf16_seconds}[fmt]

    monkeypatch.setattr(format_choice, "time_prefill_gemm", fake)
    assert format_choice.BF16_MIN_GAIN == 1.5  # 0.6 s: 1.67x fp32's speed; 0.7 s: 1.43x
    assert format_choice.bf16_prefill_faster() is want
    assert len(timed) == 2 * layout_choice.ROUNDS
    monkeypatch.setattr(layout_choice, "_memo", {})  # a new process reads the recorded answer
    assert format_choice.bf16_prefill_faster() is want and len(timed) == 2 * layout_choice.ROUNDS


def test_the_prefill_gemm_is_timed_in_each_format():
    from engine.format_choice import time_prefill_gemm

    for fmt in ("fp32", "bf16"):
        assert 0 < time_prefill_gemm(fmt, reps=1) < 10
