"""Fuzzing the GGUF and safetensors loaders (CI-sized; `python -m reliability.fuzz` runs campaigns).

Every truncated or mutated model gets a clear error (a TandemError naming the file) or a
correct load; never another exception, a hang, or an allocation sized by a corrupt count. The
inputs that once crashed the loaders are kept in tests/data/fuzz/ as recipes (reliability/fuzz.py)
over the fuzzer's deterministic seeds, and replayed here.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from reliability import fuzz
from reliability import fuzz_inputs as inputs
from common.errors import ModelFormatError
from common.model_files import load_config
from engine.loaders import load_model
from common.gguf_metadata import read_gguf_header

DATA = Path(__file__).resolve().parents[1] / "data" / "fuzz"
TIMEOUT_S = 20.0  # per load: a correct one takes milliseconds; a hang is the bug sought


@pytest.fixture(scope="module")
def seed_gguf(tmp_path_factory) -> Path:
    return inputs.write_seed_gguf(tmp_path_factory.mktemp("gguf") / "seed.gguf")


@pytest.fixture(scope="module")
def seed_hf(tmp_path_factory) -> Path:
    return inputs.write_seed_hf(tmp_path_factory.mktemp("hf") / "seed")


def _regressions(target: str) -> dict:
    cases = json.loads((DATA / f"{target}.json").read_text())
    assert cases["cases"], f"{target}.json holds no cases"
    return cases


def _check_seed(data: bytes, target: str) -> None:
    # The recipes patch offsets of these exact bytes: on other bytes they test nothing.
    assert hashlib.sha256(data).hexdigest() == _regressions(target)["seed_sha256"], (
        f"reliability/fuzz_inputs.py's {target} seed changed; the recipes in tests/data/fuzz/"
        f"{target}.json patch the old bytes: re-run `python -m reliability.fuzz --target {target} "
        "--save DIR` on the old code to regenerate them")


def test_the_seeds_load(seed_gguf, seed_hf):
    for path in (seed_gguf, seed_hf):
        assert fuzz.check_load(path, TIMEOUT_S) == "ok"
        assert load_config(path).num_layers == inputs.LAYERS


def test_every_truncated_gguf_is_refused(seed_gguf, tmp_path):
    data = seed_gguf.read_bytes()
    header = read_gguf_header(seed_gguf)
    # Up to the end of the last tensor's data nothing can load; past it only padding is cut.
    data_end = max(t.offset + math.prod(t.shape) // GGML_QUANT_SIZES[GGMLQuantizationType(
        t.ggml_type)][0] * GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)][1]
        for t in header.tensors)
    path = tmp_path / "cut.gguf"
    outcomes = set()
    for n in range(0, len(data), 7):
        path.write_bytes(data[:n])
        outcome = fuzz.check_load(path, TIMEOUT_S)
        if n < data_end:
            assert outcome != "ok", f"a GGUF cut to {n} of {len(data)} bytes loaded"
        outcomes.add(outcome.split(":")[0])
    assert outcomes >= {"ModelFormatError"}


def test_every_truncated_safetensors_is_refused(seed_hf, tmp_path):
    data = (seed_hf / "model.safetensors").read_bytes()
    model_dir = tmp_path / "cut"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((seed_hf / "config.json").read_text())
    for n in range(0, len(data), 11):
        (model_dir / "model.safetensors").write_bytes(data[:n])
        outcome = fuzz.check_load(model_dir, TIMEOUT_S)
        assert outcome.startswith("ModelFormatError"), f"cut to {n} bytes: {outcome}"


@pytest.mark.parametrize("target,examples", [("gguf", 3000), ("safetensors", 1500),
                                             ("frames", 3000)])
def test_random_mutations_never_crash(target, examples, tmp_path):
    report = fuzz.TARGETS[target](examples, 1234, tmp_path, TIMEOUT_S)
    assert report.examples == examples
    assert not report.crashes, "\n".join(report.lines() + [report.crashes[0]["traceback"]])
    # The mutations reach past the first check: both loads and several kinds of refusal.
    assert len(report.outcomes) >= 8, report.lines()
    assert any(k.startswith("ok") for k in report.outcomes), report.lines()


def test_the_campaign_command_reports_its_size(capsys):
    assert fuzz.main(["--target", "gguf", "--examples", "200", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "target gguf: 200 examples, 0 crashes" in out and "distinct outcomes" in out


def test_gguf_inputs_that_once_crashed(seed_gguf, tmp_path):
    seed = seed_gguf.read_bytes()
    _check_seed(seed, "gguf")
    path = tmp_path / "case.gguf"
    for case in _regressions("gguf")["cases"]:
        path.write_bytes(inputs.apply_recipe(seed, case["recipe"]))
        outcome = fuzz.check_load(path, TIMEOUT_S)  # raises on a crash, a hang, a bad message
        assert outcome != "ok", f"{case['recipe']} (once {case['was']}) loaded"


def test_safetensors_inputs_that_once_crashed(seed_hf, tmp_path):
    seed = (seed_hf / "model.safetensors").read_bytes()
    _check_seed(seed, "safetensors")
    model_dir = tmp_path / "case"
    model_dir.mkdir()
    for case in _regressions("safetensors")["cases"]:
        inputs.apply_hf_recipe(model_dir, seed, case["recipe"])
        # Raises on a crash; a load is right for some (a model_type of the wrong type falls
        # back to `architectures`, as for an unknown one) and check_load checked it.
        fuzz.check_load(model_dir, TIMEOUT_S)


# ---- the bugs the fuzzer found, each written out by hand ------------------------------------

def _patch_u32_after(data: bytes, key: bytes, value: int) -> bytes:
    """Set the u32 value of GGUF key/value `key` (its type id follows the key)."""
    at = data.index(key) + len(key) + 4
    return data[:at] + struct.pack("<I", value) + data[at + 4:]


def test_a_huge_block_count_is_a_missing_layer_not_a_hang(seed_gguf, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(_patch_u32_after(seed_gguf.read_bytes(), b"llama.block_count", 1 << 31))
    with pytest.raises(ModelFormatError, match=r"missing tensor blk\.1\.attn_norm\.weight"):
        load_model(path)


def test_a_zero_head_count_is_named(seed_gguf, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(_patch_u32_after(seed_gguf.read_bytes(), b"llama.attention.head_count", 0))
    with pytest.raises(ModelFormatError, match="head_count must be a positive integer, got 0"):
        load_config(path)


def test_tensor_dimensions_that_overflow_int64_are_refused(seed_gguf, tmp_path):
    data = bytearray(seed_gguf.read_bytes())
    # token_embd.weight's ne: n_dims u32 then ne[0], ne[1] as u64; 2**40 * 2**40 wraps to 0
    # in numpy's int64 product and used to pass the size check.
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4
    data[at:at + 16] = struct.pack("<QQ", 1 << 40, 1 << 40)
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="truncated: tensor token_embd.weight"):
        load_model(path)
    data[at:at + 16] = struct.pack("<QQ", 0, (1 << 64) - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="token_embd.weight has a zero dimension"):
        load_model(path)


@pytest.mark.parametrize("field,value,message", [
    ("num_attention_heads", [2], "num_attention_heads must be a positive integer"),
    ("hidden_size", "32", "hidden_size must be a positive integer"),
    ("head_dim", 0.5, "head_dim must be a positive integer"),
    ("rope_scaling", "linear", "rope_scaling must be an object"),
    ("rope_parameters", 3, "rope_parameters must be an object"),
    ("rms_norm_eps", [], "rms_norm_eps must be a number"),
    ("rope_theta", float("nan"), "rope_theta must be positive"),
    ("num_hidden_layers", 10 ** 15, "missing tensor model.layers.1.input_layernorm.weight"),
    ("vocab_size", 16.0, "vocab_size must be an integer"),
])
def test_config_json_of_the_wrong_type_is_named(seed_hf, tmp_path, field, value, message):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    inputs.apply_hf_recipe(model_dir, (seed_hf / "model.safetensors").read_bytes(),
                           {"config": {field: value}})
    with pytest.raises(ModelFormatError, match=message) as caught:
        load_model(model_dir)
    assert str(model_dir) in str(caught.value)
