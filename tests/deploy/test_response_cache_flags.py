"""--response-cache from `tandem serve` to the coordinator (its only user), checked by both."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.__main__ import build_parser
from coordinator.__main__ import main as coordinator_main
from coordinator.response_cache_config import ResponseCacheConfig
from deploy.process_plan import plan
from tests.helpers.coordinator_fakes import make_tiny_model_dir


def _served(tmp_path, monkeypatch, *flags: str):
    import cli.main
    import deploy.local

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}
    monkeypatch.setattr(deploy.local, "serve",
                        lambda topology, **kw: seen.setdefault("t", topology) and 0)
    code = cli.main.main(["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                          *flags])
    return code, seen.get("t")


def test_tandem_serve_gives_the_coordinator_its_response_cache(tmp_path, monkeypatch):
    code, topology = _served(tmp_path, monkeypatch, "--response-cache", "semantic:threshold=0.9")
    assert code == 0
    ports = iter(range(23100, 23200))
    specs, _ = plan(topology, lambda: next(ports))
    coordinator = next(s for s in specs if s.name == "coordinator")
    args = build_parser().parse_args(coordinator.argv[3:])
    assert ResponseCacheConfig.parse(args.response_cache) == ResponseCacheConfig("semantic", 0.9)
    assert all("--response-cache" not in s.argv for s in specs if s.name != "coordinator")
    _, plain = _served(tmp_path, monkeypatch)
    specs, _ = plan(plain, lambda: next(ports))
    assert all("--response-cache" not in s.argv for s in specs)  # off by default


def test_a_bad_response_cache_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    code, topology = _served(tmp_path, monkeypatch, "--response-cache", "semantic:threshold=2")
    assert code != 0 and topology is None
    assert "threshold must be a cosine similarity in -1..1" in capsys.readouterr().err
    assert coordinator_main(["--model", str(tmp_path / "absent"), "--response-cache",
                             "fuzzy"]) == 1
    assert "mode must be one of exact, semantic" in capsys.readouterr().err


def test_the_coordinator_refuses_an_embedding_model_it_does_not_serve(tmp_path, monkeypatch,
                                                                      capsys):
    import coordinator.server

    chat = make_tiny_model_dir(tmp_path / "chat")
    embedder = make_tiny_model_dir(tmp_path / "emb")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    served = []
    monkeypatch.setattr(coordinator.server, "serve",
                        lambda config, models, *a: served.append((config, models)))
    assert coordinator_main(["--model", str(chat), "--response-cache",
                             "semantic:model=emb,threshold=0.8"]) == 1
    assert "the embedding model 'emb' is not served" in capsys.readouterr().err
    assert not served
    assert coordinator_main(["--model", str(chat), "--model", str(embedder),
                             "--model-name", "chat", "--model-name", "emb",
                             "--response-cache", "semantic:model=emb,threshold=0.8"]) == 0
    config, models = served[0]
    assert config.response_cache.embed_model == "emb" and models.find("emb") is not None


def test_tandem_serve_refuses_an_embedding_model_it_does_not_serve(tmp_path, monkeypatch, capsys):
    code, topology = _served(tmp_path, monkeypatch, "--response-cache",
                             "semantic:model=qwen3-embedding,threshold=0.8")
    assert code != 0 and topology is None  # before any model is resolved or pulled
    assert "the embedding model 'qwen3-embedding' is not served" in capsys.readouterr().err
    embedder = make_tiny_model_dir(tmp_path / "emb")
    code, topology = _served(tmp_path, monkeypatch, "--model", str(embedder),
                             "--response-cache", f"semantic:model={embedder},threshold=0.8")
    assert code == 0 and topology.more_models[0][1] == embedder


def test_tandem_serve_knows_an_embedder_by_its_files_name():
    """The coordinator's model answers to its path, file name and stem: so does the check."""
    from cli.serve import _response_cache

    served = ["smollm2", "/models/Qwen3-Embedding-0.6B-Q8_0.gguf"]
    for name in ("Qwen3-Embedding-0.6B-Q8_0", "Qwen3-Embedding-0.6B-Q8_0.gguf",
                 "/models/Qwen3-Embedding-0.6B-Q8_0.gguf", "smollm2:latest"):
        spec = f"semantic:model={name},threshold=0.9"
        assert _response_cache(spec, served) == ("--response-cache", spec)
    with pytest.raises(ValueError, match="'other' is not served"):
        _response_cache("semantic:model=other,threshold=0.9", served)
    assert _response_cache("semantic:model=other,threshold=0.9", served, load_on_request=True)
    # One helper lists those spellings for both, `~` expanded as the coordinator loads it.
    from common.model_name import path_spellings

    assert path_spellings("~/m/E.gguf") == (str(Path.home() / "m" / "E.gguf"), "E.gguf", "E")
    home_served = ["~/m/E.gguf"]
    assert _response_cache(f"semantic:model={Path.home()}/m/E.gguf,threshold=0.9", home_served)
