"""Models people already have: Ollama's store and the Hugging Face hub cache, built on disk in
their real layouts, resolved by name and used where they lie."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import ModelFormatError, ModelNotFoundError
from common.model_files import load_config
from common.model_name import ModelName, display_name, name_key
from common.model_store import ModelStore, default_hf_cache, default_ollama_models
from common.ollama_store import OllamaStore
from common.tokenizer import Tokenizer
from tests.helpers.foreign_stores import GO_TEMPLATE, PARAMS, make_hf_cache, make_ollama_store

def _disk_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*"))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from reliability.model_factory import make_tiny_gguf, make_tiny_hf_model

    src = tmp_path_factory.mktemp("src")
    gguf = make_tiny_gguf(src / "tiny-f32.gguf").path
    q8 = make_tiny_gguf(src / "tiny-q8.gguf", ggml_type="Q8_0").path
    hf_dir = make_tiny_hf_model(src / "hf")
    root = tmp_path_factory.mktemp("roots")
    ollama = make_ollama_store(root / "ollama", gguf)
    hf_files = {p.name: p for p in hf_dir.iterdir() if p.is_file()}
    hf = make_hf_cache(root / "hf", "org/tiny", {**hf_files, "tiny.Q8_0.gguf": q8})
    make_hf_cache(hf, "org/tiny-GGUF", {"tiny-F32.gguf": gguf, "tiny-Q8_0.gguf": q8})
    return ollama, hf


def _store(tmp_path: Path, stores) -> ModelStore:
    ollama, hf = stores
    return ModelStore(tmp_path / "home", ollama_models=ollama, hf_cache=hf)


def test_ollama_names():
    assert ModelName.parse("llama3.2").full == "registry.ollama.ai/library/llama3.2:latest"
    assert ModelName.parse("qwen3:0.6b").display == "qwen3:0.6b"
    assert ModelName.parse("library/qwen3:0.6b").display == "qwen3:0.6b"
    assert ModelName.parse("org/m:Q4_K_M").display == "org/m:Q4_K_M"
    assert ModelName.parse("hf.co/org/m:Q4_K_M").display == "hf.co/org/m:Q4_K_M"
    assert ModelName.parse("/abs/m.gguf") is None and ModelName.parse("a/b/c/d") is None
    assert display_name("smollm2") == "smollm2:latest" and display_name("/x.gguf") == "/x.gguf"
    assert len({name_key(n) for n in ("smollm2", "SmolLM2:latest", "library/smollm2",
                                     "registry.ollama.ai/library/smollm2:latest")}) == 1


def test_names_resolve_in_place_and_nothing_is_copied(tmp_path, stores):
    ollama, hf = stores
    before = _disk_bytes(ollama), _disk_bytes(hf)
    store = _store(tmp_path, stores)

    blobs = {store.resolve(n) for n in ("tiny", "tiny:latest", "library/tiny:latest",
                                        "registry.ollama.ai/library/tiny:latest")}
    (blob,) = blobs
    assert blob.parent == ollama / "blobs" and blob.name.startswith("sha256-")  # no suffix
    snapshot = store.resolve("org/tiny")
    assert snapshot.is_dir() and (snapshot / "config.json").is_file()
    for name in ("org/tiny:Q8_0", "org/tiny:q8_0", "hf.co/org/tiny:Q8_0"):
        assert store.resolve(name) == snapshot / "tiny.Q8_0.gguf"
    assert store.resolve("org/tiny-GGUF:q8_0").name == "tiny-Q8_0.gguf"
    for path in (blob, snapshot, store.resolve("org/tiny:Q8_0")):
        assert hf in path.parents or ollama in path.parents  # inside the store it came from

    # Usable where they lie: config and tokenizer (the GGUF's own Jinja template) read.
    assert load_config(blob).num_layers == 2 and load_config(snapshot).num_layers == 2
    assert "<|im_start|>" in Tokenizer.from_path(blob).chat_template
    assert (_disk_bytes(ollama), _disk_bytes(hf)) == before
    assert not (tmp_path / "home" / "models").exists()  # nothing landed in tandem's store


def test_the_stores_list_what_they_hold_by_names_that_resolve(tmp_path, stores):
    ollama, hf = stores
    store = _store(tmp_path, stores)
    (tmp_path / "home" / "models").mkdir(parents=True)
    dropped = tmp_path / "home" / "models" / "dropped.gguf"
    dropped.write_bytes(store.resolve("tiny").read_bytes())
    names = store.held_names()
    # tandem's own first, then Ollama's (by its display name), then the hub cache: a
    # Hugging Face model by its repo, a GGUF repo by each file's quantization tag.
    assert names == ["dropped", "tiny:latest", "org/tiny", "org/tiny-GGUF:F32",
                     "org/tiny-GGUF:Q8_0"]
    resolved = [store.resolve(n, paths=False) for n in names]
    assert resolved[0] == dropped and resolved[1].parent == ollama / "blobs"
    assert resolved[3].name == "tiny-F32.gguf" and resolved[4].name == "tiny-Q8_0.gguf"
    assert ModelStore(tmp_path / "empty").held_names() == []  # no folders yet: none


def test_ollama_layers_are_read(stores):
    found = OllamaStore(stores[0]).find("tiny")
    assert found.params == PARAMS and found.template == GO_TEMPLATE
    assert found.system == "You are tiny." and found.name.display == "tiny:latest"


def test_a_missing_model_names_where_it_looked(tmp_path, stores):
    ollama, hf = stores
    store = _store(tmp_path, stores)
    with pytest.raises(ModelNotFoundError) as info:
        store.resolve("nope")
    message = str(info.value)
    assert str(tmp_path / "home" / "models") in message
    assert str(ollama / "manifests/registry.ollama.ai/library/nope/latest") in message
    assert f"the Hugging Face cache ({hf})" in message
    with pytest.raises(ModelNotFoundError, match=f"Hugging Face cache \\({hf}/models--org--nope\\)"):
        store.resolve("org/nope")
    with pytest.raises(ModelNotFoundError, match=r"2 GGUF files \(tiny-F32.gguf, tiny-Q8_0.gguf\); "
                                                  "name one by its quantization tag, as org/tiny-GGUF:Q4_K_M"):
        store.resolve("org/tiny-GGUF")
    with pytest.raises(ModelNotFoundError, match="no GGUF file with 'Q2_K'.*tiny-Q8_0.gguf"):
        store.resolve("org/tiny-GGUF:Q2_K")


def test_a_broken_ollama_manifest_is_named(tmp_path, stores):
    root = tmp_path / "ollama"
    manifest = root / "manifests/registry.ollama.ai/library/bad/latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:" + "0" * 64, "size": 1}]}))
    store = ModelStore(tmp_path / "home", ollama_models=root)
    with pytest.raises(ModelNotFoundError, match="blobs/sha256-0000.*is missing"):
        store.resolve("bad")
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "../../etc/passwd"}]}))
    with pytest.raises(ModelFormatError, match="is not sha256"):
        store.resolve("bad")


def test_store_roots_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "o"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    assert default_ollama_models() == tmp_path / "o" and default_hf_cache() == tmp_path / "h/hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert default_hf_cache() == tmp_path / "c"


def test_pull_of_a_hub_repo_says_when_the_hub_is_not_reachable(tmp_path, stores):
    store = ModelStore(tmp_path / "home", hf_cache=tmp_path / "hub",
                       hf_endpoint="http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError, match=r"cannot fetch org/tiny from the Hugging Face "
                       r"hub \(http://127.0.0.1:9\): the hub is not reachable"):
        store.pull("org/tiny:Q8_0")
    assert _store(tmp_path, stores).pull("org/tiny:Q8_0").name == "tiny.Q8_0.gguf"  # cached
