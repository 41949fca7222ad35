"""--chat-template on `tandem serve` and `python -m coordinator`: checked before anything
starts, handed to the coordinator (which renders prompts) as absolute paths, one per model."""

from __future__ import annotations

import pytest

from cli.serve import _chat_template_args
from coordinator.__main__ import main as coordinator_main
from tests.helpers.coordinator_fakes import make_tiny_model_dir


def test_serve_checks_each_file_and_passes_absolute_paths(tmp_path, monkeypatch):
    good = tmp_path / "tools.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools }}")
    monkeypatch.chdir(tmp_path)
    assert _chat_template_args(["tools.jinja"], ["a", "b"]) == ("--chat-template", str(good))
    assert _chat_template_args(None, ["a"]) == ()
    with pytest.raises(ValueError, match="2 --chat-template for 1 --model"):
        _chat_template_args(["tools.jinja", "tools.jinja"], ["a"])
    (tmp_path / "go.tmpl").write_text("{{ .Prompt }}")
    with pytest.raises(ValueError, match="go.tmpl: the chat template looks like an Ollama Go"):
        _chat_template_args(["go.tmpl"], ["a"])


def test_the_coordinator_refuses_a_bad_template_file_before_serving(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    model = make_tiny_model_dir(tmp_path / "model")
    (tmp_path / "broken.jinja").write_text("{% if %}")
    argv = ["--model", str(model), "--port", "1", "--chat-template"]
    assert coordinator_main([*argv, str(tmp_path / "broken.jinja")]) == 1
    assert "broken.jinja: chat template does not parse" in capsys.readouterr().err
    assert coordinator_main([*argv, "a.jinja", "--chat-template", "b.jinja"]) == 1
    assert "2 --chat-template for 1 --model" in capsys.readouterr().err
