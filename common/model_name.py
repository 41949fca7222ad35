"""Model names as Ollama writes them: `[[host/]namespace/]model[:tag]`.

    llama3.2                              registry.ollama.ai/library/llama3.2:latest
    qwen3:0.6b                            registry.ollama.ai/library/qwen3:0.6b
    library/qwen3:0.6b                    registry.ollama.ai/library/qwen3:0.6b
    org/model:Q4_K_M                      registry.ollama.ai/org/model:Q4_K_M
    hf.co/org/model:Q4_K_M                hf.co/org/model:Q4_K_M

Missing parts take their defaults from the right, as in Ollama's `model.ParseName`; `display`
is Ollama's shortest form (`llama3.2:latest`, `org/model:Q4_K_M`), the one /api/tags lists.
Names compare without regard to case, as Ollama's do. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
NAME = re.compile(rf"{_PART}(?:/{_PART})*(?::{_PART})?")  # what a name may look like at all


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> ModelName | None:
        """The name `text` spells, defaults filled in; None for a path or anything else that is
        not `[[host/]namespace/]model[:tag]`."""
        text = text.strip()
        if not NAME.fullmatch(text):
            return None
        base, _, tag = text.partition(":")
        parts = base.split("/")
        if len(parts) > 3:
            return None
        host, namespace, model = [DEFAULT_HOST, DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
        return cls(host, namespace, model, tag or DEFAULT_TAG)

    @property
    def full(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def display(self) -> str:
        """Ollama's shortest form: the default host and `library/` dropped, the tag kept."""
        if self.host != DEFAULT_HOST:
            return self.full
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def key(self) -> str:
        """What two spellings of one name share."""
        return self.full.lower()


def name_key(text: str) -> str:
    """`text`'s ModelName.key, or `text` itself where it is no name (a path)."""
    parsed = ModelName.parse(text)
    return parsed.key if parsed else text.strip()


def path_spellings(text: str) -> tuple[str, ...]:
    """The names a model given as `text` (a name or a path) also answers to besides `text`:
    its expanded path, its file's name and stem. The coordinator's served model and
    `tandem serve`'s early checks both read this, so the two accept the same spellings."""
    path = Path(text).expanduser()
    return (str(path), path.name, path.stem)


def display_name(text: str) -> str:
    """`text` as /api/tags lists it (`smollm2` -> `smollm2:latest`); a path stays as it is."""
    parsed = ModelName.parse(text)
    return parsed.display if parsed else text
