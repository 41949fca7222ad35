"""A model's default options and system prompt (an Ollama model's params and system layers):
checked when the model is loaded, laid under each request's options as Ollama lays them, and
read from a fake Ollama store only for the name that resolves to its blob."""

from __future__ import annotations

import pytest

from common.errors import ModelFormatError
from common.model_defaults import ModelDefaults
from common.model_store import ModelStore
from common.sampling_params import SamplingParams
from tests.helpers.foreign_stores import make_ollama_store

PARAMS = {"stop": ["<|im_end|>", "END"], "temperature": 0.25, "num_ctx": 256, "top_k": 7,
          "num_predict": 3, "mirostat": 2}


def _defaults(warnings=None) -> ModelDefaults:
    return ModelDefaults.from_layers(PARAMS, "Be brief.", "manifest",
                                     None if warnings is None else warnings.append)


def test_options_tandem_does_not_read_are_left_out_and_named():
    warnings = []
    defaults = _defaults(warnings)
    assert "mirostat" not in defaults.options and defaults.options["top_k"] == 7
    assert warnings == ["manifest: model option 'mirostat' is not one tandem reads; ignored"]
    assert defaults.system == "Be brief." and defaults
    assert not ModelDefaults() and ModelDefaults.from_layers({}, "", "m").system is None


def test_a_bad_default_value_is_refused_naming_the_manifest():
    with pytest.raises(ModelFormatError, match=r"^/x/manifest: the model's default options are "
                                               r"refused: option 'temperature' must be"):
        ModelDefaults.from_layers({"temperature": -1}, None, "/x/manifest")


def test_the_request_wins_where_it_says_something():
    defaults = _defaults()
    params = SamplingParams.from_options(defaults.options_under(None))
    assert (params.temperature, params.top_k, params.num_ctx, params.num_predict) == (0.25, 7, 256, 3)
    assert params.stop == ("<|im_end|>", "END")
    merged = defaults.options_under({"temperature": 0, "stop": ["x"], "top_k": None})
    params = SamplingParams.from_options(merged)
    assert (params.temperature, params.stop, params.top_k) == (0.0, ("x",), 7)  # null: not given
    assert defaults.options_under("nope") == "nope"  # from_options refuses it in its own words


def test_the_system_prompt_opens_a_chat_without_one():
    defaults = _defaults()
    user = [{"role": "user", "content": "hi"}]
    assert defaults.with_system(user) == [{"role": "system", "content": "Be brief."}, *user]
    own = [{"role": "system", "content": "mine"}, *user]
    assert defaults.with_system(own) == own and defaults.with_system([]) == []
    assert ModelDefaults().with_system(user) == user
    assert _defaults().parameter_items()[:3] == [("stop", "<|im_end|>"), ("stop", "END"),
                                                 ("temperature", 0.25)]


def test_the_store_gives_defaults_only_to_the_ollama_name_of_the_blob(tmp_path):
    from reliability.model_factory import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf").path
    root = make_ollama_store(tmp_path / "ollama", gguf, params=PARAMS, system="Be brief.")
    store = ModelStore(tmp_path / "home", ollama_models=root)
    blob = store.resolve("tiny:latest")
    defaults = store.defaults_for("tiny:latest", blob)
    assert defaults.options["num_ctx"] == 256 and defaults.system == "Be brief."
    assert store.defaults_for("tiny", blob) == defaults
    assert not store.defaults_for(str(gguf), gguf)  # the same weights by path: no layers
    assert not store.defaults_for("tiny", gguf)  # a name that resolved elsewhere
    assert not ModelStore(tmp_path / "home").defaults_for("tiny", blob)  # no Ollama store
