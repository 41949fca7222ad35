"""The model packs its layers inside kernels.layout_choice.model_weights of its layers' weights,
so a layout choice knows whether a decode step streams them from memory."""

from __future__ import annotations

import contextlib

from engine.loaders import load_model
from engine.models import llama, model_class
from kernels import layout_choice
from reliability.model_factory import make_tiny_gguf


def test_layers_are_packed_knowing_the_models_size(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    make_tiny_gguf(path, "Q4_1", hidden=64, layers=2)
    loaded = load_model(path)
    seen = []
    real_pack = llama.pack_linear

    def pack_linear(*args, **kwargs):
        seen.append(layout_choice._model_weights.get())
        return real_pack(*args, **kwargs)

    counts = []

    @contextlib.contextmanager
    def recording(count):
        counts.append(count)
        with layout_choice.model_weights(count):
            yield

    monkeypatch.setattr(llama, "pack_linear", pack_linear)
    monkeypatch.setattr(llama, "model_weights", recording)
    model_class(loaded.config.architecture)(loaded.config, loaded.weights, "int4")
    c = loaded.config
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim \
        + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    assert counts == [c.num_layers * per_layer]
    assert seen and set(seen) == {counts[0]}  # every matrix, the lm_head too
    assert layout_choice._model_weights.get() == 0  # and none after
