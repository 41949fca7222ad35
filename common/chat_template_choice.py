"""Which chat template a served model renders: an operator's, a stored one, a shipped one, or
the model's own.

In order, the first that applies:

    flag      `--chat-template FILE` (tandem serve, python -m coordinator): that file
    stored    the `template` given to /api/create for the name being served (its manifest)
    shipped   a tools-capable template tandem ships for the model's family, when the model's
              own template is exactly that family's template without tools (matched by the
              sha256 of the template text, which the known-models list records beside the
              shipped file: common/model_store.py's REGISTRY). So SmolLM2 takes tools
              wherever its file lies (pulled, Ollama's store, a path), as Ollama's library
              ships it, and a model whose template differs in one byte keeps its own.
    model     the template the model file carries (GGUF tokenizer.chat_template, or
              tokenizer_config.json / chat_template.jinja), ChatML when it has none

Every template but the model's own is checked to parse before it is used. Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from common.chat_template import check_template
from common.errors import ChatTemplateError
from common.model_name import name_key
from common.model_store import REGISTRY

SHIPPED_FOLDER = "chat_templates"  # under common/, package data (pyproject.toml)


@dataclass(frozen=True)
class TemplateChoice:
    template: str | None  # None: the model has none (ChatML is rendered)
    source: str  # "flag FILE" | "stored" | "shipped FILE" | "model"


def shipped_template(name: str) -> str:
    """A template file shipped in common/chat_templates/ (package data)."""
    return resources.files("common").joinpath(SHIPPED_FOLDER, name).read_text(encoding="utf-8")


def shipped_for(own_template: str | None) -> str | None:
    """The shipped file that stands in for `own_template`, if a known model family's."""
    if not own_template:
        return None
    digest = hashlib.sha256(own_template.encode("utf-8")).hexdigest()
    return next((e.tools_template for e in REGISTRY.values()
                 if e.tools_template and e.own_template_sha256 == digest), None)


def read_template_file(path: str | Path) -> str:
    """The text of a `--chat-template FILE`, checked to parse; ChatTemplateError naming the
    file otherwise."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {path}: cannot read it: {exc}") from None
    try:
        return check_template(text)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"--chat-template {path}: {exc}") from None


def templates_by_model(values: list[str]) -> dict[str, str]:
    """`--chat-template-for MODEL=FILE` values as {name_key(MODEL): absolute FILE}, each file
    checked to parse; the first "=" splits (a file path may hold one, a model name never
    does). ChatTemplateError naming the value otherwise, or a model given twice."""
    found: dict[str, str] = {}
    for value in values:
        model, eq, file = value.partition("=")
        if not (model.strip() and eq and file):
            raise ChatTemplateError(f"--chat-template-for {value!r}: expected MODEL=FILE, "
                                    "e.g. qwen3:0.6b=tools.jinja")
        key = name_key(model.strip())
        if key in found:
            raise ChatTemplateError(f"--chat-template-for gives {model!r} a template twice")
        read_template_file(file)
        found[key] = str(Path(file).expanduser().resolve())
    return found


def check_templates_served(templates: dict[str, str], models: list[str],
                           load_on_request: bool) -> None:
    """ValueError where --chat-template-for names a model no --model (`models`: given names
    and --model-name ones) serves and no request may load (without --load-on-request)."""
    served = {name_key(m) for m in models}
    unserved = [k for k in templates if k not in served]
    if unserved and not load_on_request:
        raise ValueError(f"--chat-template-for names {unserved[0]!r}, which no --model "
                         "serves (give --load-on-request for a model a request loads)")


def choose_template(own: str | None, flag_file: str | Path | None = None,
                    stored: str | None = None) -> TemplateChoice:
    """The module docstring's order."""
    if flag_file is not None:
        return TemplateChoice(read_template_file(flag_file), f"flag {flag_file}")
    if stored is not None:
        return TemplateChoice(check_template(stored), "stored")
    shipped = shipped_for(own)
    if shipped is not None:
        return TemplateChoice(shipped_template(shipped), f"shipped {shipped}")
    return TemplateChoice(own, "model")
