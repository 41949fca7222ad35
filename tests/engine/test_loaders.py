"""Loaders: HF directories and GGUF files -> config + HF-named weights, checked against
transformers (the oracle) and against the weights a tiny model was written from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from common.pooling import Pooling
from common.model_config import RopeScaling
from common.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from common.model_files import load_config
from engine.loaders import load_model, weight_shapes
from engine.loaders.gguf_loader import unpermute_rows
from common.gguf_metadata import gguf_config, read_gguf_metadata
from common.hf_config import hf_model_config
from kernels.quantized_tensor import QuantizedTensor
from reliability.model_factory import llama_cpp_permute, make_tiny_gguf, make_tiny_hf_model

REPO = Path(__file__).resolve().parents[2]


def _transformers_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return state


# --- Hugging Face directories ---------------------------------------------------------------


@pytest.mark.parametrize("arch,shards,tie", [
    ("llama", 1, False), ("llama", 3, True), ("qwen2", 1, True), ("qwen2", 2, False),
    ("mistral", 1, False), ("qwen3", 1, True), ("qwen3", 2, False),
])
def test_hf_weights_match_transformers(tmp_path, arch, shards, tie):
    model_dir = make_tiny_hf_model(tmp_path / arch, arch=arch, shards=shards, tie=tie, seed=3)
    if shards > 1:
        assert (model_dir / "model.safetensors.index.json").is_file()
    loaded = load_model(model_dir)
    reference = _transformers_state_dict(model_dir)

    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers,
            c.num_heads, c.num_kv_heads, c.head_dim) == (arch, 320, 64, 128, 2, 4, 2, 16)
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert c.tie_word_embeddings == tie
    assert c.max_position == 512 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert loaded.format == "hf" and loaded.path == model_dir
    assert loaded.generation_config["eos_token_id"] == 2
    assert set(loaded.weights) == set(weight_shapes(c)) == set(reference)
    for name, ref in reference.items():
        assert torch.equal(loaded.weights[name], ref), name
    tied = loaded.weights["lm_head.weight"] is loaded.weights["model.embed_tokens.weight"]
    assert tied == tie
    assert load_config(model_dir) == c


def test_hf_keeps_stored_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, model_dir / "model.safetensors")
    loaded = load_model(model_dir)
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    assert torch.equal(loaded.weights["model.norm.weight"], weights["model.norm.weight"].bfloat16())


def test_hf_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    model_dir = make_tiny_hf_model(tmp_path / "m", rope_scaling=scaling, with_tokenizer=False,
                                   max_position=1024)
    config = load_config(model_dir)
    assert config.rope_scaling == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position=256)
    assert config.max_position == 1024


BASE_CONFIG = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def test_hf_config_legacy_rope_spelling():
    # transformers 4.x checkpoints: rope_theta at top level, rope_scaling with "type".
    config = hf_model_config({**BASE_CONFIG, "rope_theta": 500000.0,
                              "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("linear", factor=2.0)
    assert config.num_kv_heads == 4 and config.head_dim == 16
    llama3 = hf_model_config({**BASE_CONFIG, "rope_theta": 500000.0, "head_dim": 32,
                              "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192}})
    assert llama3.rope_scaling.kind == "llama3" and llama3.rope_scaling.factor == 32.0
    assert llama3.head_dim == 32


def test_hf_config_sliding_window_caps_context():
    mistral_v01 = hf_model_config({**BASE_CONFIG, "model_type": "mistral",
                                   "max_position_embeddings": 32768, "sliding_window": 4096})
    assert mistral_v01.max_position == 4096
    qwen_off = hf_model_config({**BASE_CONFIG, "model_type": "qwen2", "max_position_embeddings":
                                32768, "sliding_window": 4096, "use_sliding_window": False})
    assert qwen_off.max_position == 32768 and qwen_off.attention_bias


@pytest.mark.parametrize("change,error,words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModelError, "yarn"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, UnsupportedModelError, "gpt2"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "gelu"),
    ({"num_key_value_heads": 3}, ModelFormatError, "num_kv_heads"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ModelFormatError, "low_freq_factor"),
])
def test_hf_config_rejects(change, error, words):
    with pytest.raises(error, match=words):
        hf_model_config({**BASE_CONFIG, **change})


def test_hf_config_missing_key():
    config = dict(BASE_CONFIG)
    del config["hidden_size"]
    with pytest.raises(ModelFormatError, match="hidden_size"):
        hf_model_config(config)


def test_hf_dir_without_weights(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelFormatError, match=r"no weights.*pytorch_model\.bin"):
        load_model(model_dir)


def test_hf_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ModelFormatError, match="config.json"):
        load_config(tmp_path)


def test_hf_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_hf_model(tmp_path / "m", with_tokenizer=False)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj"):
        load_model(model_dir)


def test_hf_missing_shard_and_corrupt_safetensors(tmp_path):
    model_dir = make_tiny_hf_model(tmp_path / "m", shards=2, with_tokenizer=False)
    shard = sorted(model_dir.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\x00" * 5)
    with pytest.raises(ModelFormatError, match=shard.name):
        load_model(model_dir)
    shard.unlink()
    with pytest.raises(ModelFormatError, match=f"lists {shard.name}, which is missing"):
        load_model(model_dir)


def test_hf_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json"):
        load_config(tmp_path)


# --- GGUF: tiny files written the llama.cpp way ---------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 16 * 3).reshape(8 * 16, 3)
    permuted = llama_cpp_permute(w, 8)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(permuted[unpermute_rows(8 * 16, 8)], w)


def test_gguf_f32_round_trips_exactly(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", "F32")
    loaded = load_model(tiny.path)
    assert loaded.format == "gguf" and loaded.generation_config == {}
    assert set(loaded.weights) == set(tiny.state_dict)
    for name, ref in tiny.state_dict.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and torch.equal(got, ref), name
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.max_position) == ("llama", 320, 64, 2, 4, 2, 16, 512)
    assert c.name == "m" and not c.tie_word_embeddings
    assert load_config(tiny.path) == c


@pytest.mark.parametrize("ggml_type", ["F16", "BF16"])
def test_gguf_half_types_keep_dtype(tmp_path, ggml_type):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", ggml_type)
    loaded = load_model(tiny.path)
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[ggml_type]
    for name, ref in tiny.state_dict.items():
        got = loaded.weights[name]
        # llama.cpp keeps 1-D tensors (norms) in F32.
        assert got.dtype == (dtype if ref.ndim == 2 else torch.float32), name
        assert torch.equal(got, ref.to(got.dtype)), name


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quantized_stay_blocks_and_unpermute(tmp_path, ggml_type):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", ggml_type, tie=True)
    loaded = load_model(tiny.path)
    qtype = GGMLQuantizationType[ggml_type]
    assert loaded.config.tie_word_embeddings
    assert loaded.weights["lm_head.weight"] is loaded.weights["model.embed_tokens.weight"]
    for name, ref in tiny.state_dict.items():
        got = loaded.weights[name]
        if ref.ndim == 1:
            assert torch.equal(got, ref), name
            continue
        assert isinstance(got, QuantizedTensor) and got.ggml_type == ggml_type, name
        assert got.shape == tuple(ref.shape), name
        # Blocks run along rows, so quantizing then permuting rows equals permuting then
        # quantizing: the unpermuted blocks must dequantize to exactly quant(ref).
        expected = quants.dequantize(quants.quantize(ref.numpy(), qtype), qtype)
        assert torch.equal(got.dequantize(), torch.from_numpy(expected)), name


def test_gguf_qwen2_is_not_permuted_and_has_biases(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "q.gguf", "F32", arch="qwen2")
    loaded = load_model(tiny.path)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    for name, ref in tiny.state_dict.items():
        assert torch.equal(loaded.weights[name], ref), name


def test_gguf_qwen3_has_qk_norms_and_its_own_head_dim(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "q3.gguf", "F32", arch="qwen3", head_dim=32, tie=True)
    loaded = load_model(tiny.path)
    c = loaded.config
    assert (c.architecture, c.qk_norm, c.attention_bias, c.head_dim) == ("qwen3", True, False, 32)
    assert c.tie_word_embeddings and c.q_size == 128 != c.hidden_size
    assert set(loaded.weights) == set(tiny.state_dict) | {"lm_head.weight"}
    for name, ref in tiny.state_dict.items():  # NEOX RoPE: q/k stored unpermuted
        assert torch.equal(loaded.weights[name], ref), name
    assert load_config(tiny.path) == c


def test_hf_config_qwen3():
    config = hf_model_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                              "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                              "num_hidden_layers": 28, "num_attention_heads": 16,
                              "num_key_value_heads": 8, "head_dim": 128,
                              "max_position_embeddings": 40960, "sliding_window": None,
                              "use_sliding_window": False, "rope_theta": 1000000,
                              "tie_word_embeddings": True, "attention_bias": False})
    assert (config.architecture, config.qk_norm, config.attention_bias) == ("qwen3", True, False)
    assert (config.head_dim, config.q_size, config.max_position) == (128, 2048, 40960)
    window_off = hf_model_config({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64,
                                  "intermediate_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "sliding_window": 4096,
                                  "use_sliding_window": False, "max_position_embeddings": 40960})
    assert window_off.max_position == 40960


def test_gguf_metadata_is_plain_python(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", "F32")
    meta = read_gguf_metadata(tiny.path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2 and meta["llama.rope.freq_base"] == 10000.0
    assert len(meta["tokenizer.ggml.tokens"]) == 320
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    config = gguf_config(meta)
    assert config.vocab_size == 320 and config.name == "tiny-test-model"
    # The embedding default the file names (llama.cpp's enum llama_pooling_type): only "last"
    # (3) changes it; none (0), mean (1), cls (2), rank (4) and an absent key read as mean.
    assert config.pooling is Pooling.MEAN
    for number, pooling in ((0, Pooling.MEAN), (1, Pooling.MEAN), (2, Pooling.MEAN),
                            (3, Pooling.LAST), (4, Pooling.MEAN)):
        assert gguf_config({**meta, "llama.pooling_type": number}).pooling is pooling, number


def test_config_path_is_torch_free(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", "F32")
    model_dir = make_tiny_hf_model(tmp_path / "hf", with_tokenizer=False)
    code = (
        "import sys\n"
        "import engine.loaders, common.gguf_metadata, common.hf_config\n"
        "import common.model_store\n"
        "from common.model_files import load_config\n"
        f"load_config({str(tiny.path)!r}); load_config({str(model_dir)!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- GGUF: bad and unsupported files --------------------------------------------------------


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]],
                hidden: int = 256) -> Path:
    writer = GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", hidden), ("context_length", 128),
                       ("feed_forward_length", 256), ("attention.head_count", 4),
                       ("attention.head_count_kv", 4), ("vocab_size", 8)):
        writer.add_uint32(f"{arch}.{key}", value)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="nowhere.gguf"):
        load_model("/nonexistent/nowhere.gguf")
    with pytest.raises(ModelNotFoundError, match="nowhere.gguf"):
        load_config("/nonexistent/nowhere.gguf")


def test_text_file_named_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n" * 10)
    with pytest.raises(ModelFormatError, match=r"notes\.gguf.*not a GGUF file"):
        load_model(path)


def test_truncated_tensor_data(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    data = tiny.path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    load_config(cut)  # the header is intact
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: truncated: tensor"):
        load_model(cut)


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2",
                       {"token_embd.weight": (np.zeros((8, 256), np.float32), None)})
    with pytest.raises(UnsupportedModelError, match=r"gpt2\.gguf.*architecture 'gpt2'"):
        load_model(path)


def test_unsupported_quant_type(tmp_path):
    block_bytes = 84  # one Q2_K super-block: 256 weights
    path = _write_gguf(tmp_path / "q2k.gguf", "llama", {
        "token_embd.weight": (np.zeros((8, block_bytes), np.uint8), GGMLQuantizationType.Q2_K)})
    with pytest.raises(UnsupportedModelError, match=r"token_embd\.weight has ggml type Q2_K"):
        load_model(path)


def test_gguf_rope_freqs_tensor_is_refused(tmp_path):
    path = _write_gguf(tmp_path / "l31.gguf", "llama",
                       {"rope_freqs.weight": (np.ones(32, np.float32), None)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_config(path)


def test_gguf_missing_and_misshapen_tensors(tmp_path):
    path = _write_gguf(tmp_path / "part.gguf", "llama",
                       {"token_embd.weight": (np.zeros((8, 256), np.float32), None)})
    with pytest.raises(ModelFormatError, match=r"missing tensor output_norm\.weight"):
        load_model(path)
    path = _write_gguf(tmp_path / "shape.gguf", "llama",
                       {"token_embd.weight": (np.zeros((9, 256), np.float32), None)})
    with pytest.raises(ModelFormatError, match=r"token_embd\.weight has shape \[9, 256\]"):
        load_model(path)


def test_gguf_unknown_tensor(tmp_path):
    path = _write_gguf(tmp_path / "extra.gguf", "llama",
                       {"blk.0.attn_qkv.weight": (np.zeros((8, 256), np.float32), None)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_qkv\.weight"):
        load_model(path)


# --- the real default model -----------------------------------------------------------------


@pytest.mark.model
def test_default_gguf_config(default_gguf):
    config = load_config(default_gguf)
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size, config.rope_theta,
            config.max_position, config.intermediate_size) == (
        "llama", 30, 576, 9, 3, 64, 49152, 100000.0, 8192, 1536)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.model
def test_default_gguf_truncated(default_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as f:
        cut.write_bytes(f.read(1000))
    with pytest.raises(ModelFormatError, match=r"cut\.gguf.*truncated"):
        load_model(cut)


@pytest.fixture(scope="module")
def transformers_gguf_weights(default_gguf):
    """transformers' own GGUF reading: dequantized fp32, un-permuted Q/K. Called below
    from_pretrained's level because from_pretrained(gguf_file=...) requires `accelerate`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(**load_gguf_checkpoint(str(default_gguf))["config"])
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    return load_gguf_checkpoint(str(default_gguf), return_tensors=True,
                                model_to_load=skeleton)["tensors"]


@pytest.mark.model
def test_default_gguf_matches_transformers(default_gguf, transformers_gguf_weights):
    loaded = load_model(default_gguf)
    weights = loaded.weights
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    assert weights["model.embed_tokens.weight"].ggml_type == "Q8_0"
    q0 = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q0, QuantizedTensor) and q0.ggml_type == "Q4_1" and q0.shape == (576, 576)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight",
                 "model.layers.7.input_layernorm.weight", "model.norm.weight"):
        ours = weights[name]
        ours = ours.dequantize() if isinstance(ours, QuantizedTensor) else ours
        assert torch.equal(ours, transformers_gguf_weights[name]), name
