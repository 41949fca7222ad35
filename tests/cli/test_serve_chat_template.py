"""--chat-template on `tandem serve` and `python -m coordinator`: checked before anything
starts, handed to the coordinator (which renders prompts) as absolute paths, one per model."""

from __future__ import annotations

import pytest

import argparse

from cli.serve import _chat_template_args, _templates_for_args
from common.errors import ChatTemplateError
from coordinator.__main__ import _template_of, main as coordinator_main
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


def test_templates_by_model_name_a_served_model_or_one_loaded_on_request(tmp_path, monkeypatch,
                                                                        capsys):
    good = tmp_path / "tools.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools }}")
    monkeypatch.chdir(tmp_path)

    def args(values, on_request=False, **kw):
        return argparse.Namespace(chat_template_for=values, load_on_request=on_request,
                                  chat_template=kw.get("positional", []),
                                  model_name=kw.get("names", []))

    assert _templates_for_args(args(["a:latest=tools.jinja"]), ["a"]) == (
        "--chat-template-for", f"a:latest={good}")
    assert _templates_for_args(args(["qwen3:0.6b=tools.jinja"], on_request=True), ["a"]) == (
        "--chat-template-for", f"qwen3:0.6b={good}")
    with pytest.raises(ValueError, match="no --model serves .*--load-on-request"):
        _templates_for_args(args(["qwen3:0.6b=tools.jinja"]), ["a"])
    with pytest.raises(ChatTemplateError, match="expected MODEL=FILE"):
        _templates_for_args(args(["tools.jinja"]), ["a"])
    with pytest.raises(ChatTemplateError, match="a template twice"):
        _templates_for_args(args(["a=tools.jinja", "library/a=tools.jinja"]), ["a"])
    (tmp_path / "go.tmpl").write_text("{{ .Prompt }}")
    with pytest.raises(ChatTemplateError, match="go.tmpl: the chat template looks like"):
        _templates_for_args(args(["a=go.tmpl"]), ["a"])

    # The coordinator: a --model by its name or its --model-name; not both ways at once.
    templates = {"registry.ollama.ai/library/a:latest": str(good)}
    assert _template_of(0, "a", args([]), templates) == str(good)
    assert _template_of(0, "/m.gguf", args([], names=["a"]), templates) == str(good)
    assert _template_of(0, "b", args([]), templates) is None
    with pytest.raises(ValueError, match="a chat template twice"):
        _template_of(0, "a", args([], positional=["x.jinja"]), templates)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    model = make_tiny_model_dir(tmp_path / "model")
    assert coordinator_main(["--model", str(model), "--port", "1", "--chat-template-for",
                             f"gamma={good}"]) == 1
    assert "names 'registry.ollama.ai/library/gamma:latest', which no --model serves" in (
        capsys.readouterr().err)
