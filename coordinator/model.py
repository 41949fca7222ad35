"""The model the coordinator serves: config, tokenizer and identity, without any weights.

The coordinator renders chat templates and tokenizes, so it needs the tokenizer; it checks
prompt lengths, so it needs the context length; it refuses workers of another model, so it
needs the fingerprint; it applies the model's default options and system prompt (an Ollama
model's params and system layers, common/model_defaults.py), so it holds those. Everything else
about the model lives on the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from common.chat_template_choice import choose_template
from common.errors import ModelNotFoundError
from common.model_defaults import ModelDefaults
from common.model_config import ModelConfig
from common.model_files import load_config
from common.model_identity import model_fingerprint
from common.model_name import display_name, name_key, path_spellings
from common.model_store import ModelStore
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str  # the name responses carry
    names: frozenset[str]  # every name a request may use for it
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer  # its chat_template is the one chosen (common/chat_template_choice.py)
    fingerprint: str
    # Options under each request's, and the system prompt of a chat without one: an Ollama
    # model's params/system layers, the system message /api/create kept overriding the layer's.
    defaults: ModelDefaults = ModelDefaults()

    @property
    def context_len(self) -> int:
        return self.config.max_position

    @property
    def listed_name(self) -> str:
        """The name /api/tags, /api/ps, /api/show and /v1/models list: Ollama's `name:tag`."""
        return display_name(self.name)

    def answers_to(self, name: str) -> bool:
        """Spellings of one Ollama name are one model: "smollm2", "smollm2:latest",
        "library/smollm2" and "registry.ollama.ai/library/smollm2:latest"."""
        return name in self.names or name_key(name) in {name_key(n) for n in self.names}

    def require(self, name: str) -> None:
        """A ModelNotFoundError (HTTP 404, gRPC NOT_FOUND) unless this model answers to `name`."""
        if not self.answers_to(name):
            raise ModelNotFoundError(f"model '{shown(name)}' not found")


def shown(text: str, limit: int = 100) -> str:
    """`text` as an error message may echo it: at most `limit` characters, then "..."."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def load_from_store(store: ModelStore, given: str, name: str,
                    template_file: str | Path | None = None,
                    warn: Callable[[str], None] | None = None,
                    path: Path | None = None) -> ServedModel:
    """The model `given` names in the store (or a path), served as `name`, with what
    /api/create kept with that name (its template, its system message). `path`: where the
    caller resolved `given` already (a client's name, resolved without probing paths)."""
    path = store.resolve(given) if path is None else path
    entry = store.entry(given)
    stored = store.overrides(given)
    # Every store name of the same file answers too (copies made by /api/copy, names made from
    # its blob), except those create gave another template or system message.
    aliases = [*(entry.names if entry is not None else ()),
               *(n for n in store.names_for(path) if store.overrides(n) == stored)]
    # An Ollama model's params and system layers: its requests' defaults (`warn` hears the
    # options tandem does not read).
    defaults = store.defaults_for(given, path, warn)
    if stored.system:
        defaults = replace(defaults, system=stored.system)
    return load_served_model(path, name, aliases, template_file=template_file,
                             stored_template=stored.template, defaults=defaults)


def load_served_model(path: str | Path, name: str, aliases: Iterable[str] = (),
                      template_file: str | Path | None = None, stored_template: str | None = None,
                      defaults: ModelDefaults = ModelDefaults()) -> ServedModel:
    """Reads metadata and tokenizer only (no tensor data); raises the engine's TandemErrors.
    The chat template: `template_file` (--chat-template), else `stored_template` (the store's,
    from /api/create), else a shipped one for the model's family, else the model's own
    (common/chat_template_choice.py)."""
    path = Path(path).expanduser()
    config = load_config(path)
    tokenizer = Tokenizer.from_path(path)
    choice = choose_template(tokenizer.chat_template, template_file, stored_template)
    if choice.source != "model":
        log.info("model %s renders the chat template of %s", name, choice.source)
        tokenizer = tokenizer.with_chat_template(choice.template)
    names = {name, *aliases, *path_spellings(str(path))}
    return ServedModel(name=name, names=frozenset(n for n in names if n), path=path,
                       config=config, tokenizer=tokenizer,
                       fingerprint=model_fingerprint(path, config), defaults=defaults)
