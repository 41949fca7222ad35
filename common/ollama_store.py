"""Models Ollama has already pulled, read where they lie in Ollama's store (read-only: tandem
never writes there and copies nothing).

Layout under the root ($OLLAMA_MODELS or ~/.ollama/models, read only by entry points):

    root/manifests/<host>/<namespace>/<model>/<tag>   JSON: {"layers": [{mediaType, digest, size}]}
    root/blobs/sha256-<hex>                           each layer's bytes, named by digest

A name maps onto its manifest through common/model_name.py (`llama3.2` is
manifests/registry.ollama.ai/library/llama3.2/latest). Of the layers:

    application/vnd.ollama.image.model     the GGUF file, served in place (found by its magic,
                                           since a blob has no .gguf suffix)
    application/vnd.ollama.image.template  a Go template: not used. tandem renders the Jinja
                                           template the GGUF carries (tokenizer.chat_template),
                                           which Ollama's library models all have
    application/vnd.ollama.image.params    JSON defaults (stop, temperature, num_ctx, ...): the
                                           model's default options, under each request's own
                                           (common/model_defaults.py, ModelStore.defaults_for)
    application/vnd.ollama.image.system    the default system prompt of a chat without one

Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ModelFormatError, ModelNotFoundError
from common.gguf_metadata import is_gguf_file
from common.model_name import ModelName

MEDIA = "application/vnd.ollama.image."
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class OllamaModel:
    name: ModelName
    gguf: Path  # the model blob, inside the store
    template: str | None = None  # Go template text; not used (see the module docstring)
    params: dict[str, Any] = field(default_factory=dict)  # applied: common/model_defaults.py
    system: str | None = None  # likewise


class OllamaStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def manifest_path(self, name: ModelName) -> Path:
        return self.root / "manifests" / name.host / name.namespace / name.model / name.tag

    def where(self, text: str) -> str:
        """Where find(text) looks, for an error message."""
        parsed = ModelName.parse(text)
        return str(self.manifest_path(parsed) if parsed else self.root / "manifests")

    def names(self) -> list[ModelName]:
        """Every name a manifest is stored under, from the folder listing alone (find() reads
        and checks the manifest and its blobs)."""
        top = self.root / "manifests"
        if not top.is_dir():
            return []
        return [ModelName(*tag.parts[-4:-1], tag.name)
                for tag in sorted(top.glob("*/*/*/*")) if tag.is_file()]

    def find(self, text: str) -> OllamaModel | None:
        """The model Ollama's store holds under the name `text`; None if it holds no such name.
        ModelFormatError for a manifest or model blob that is there but unusable."""
        parsed = ModelName.parse(text)
        if parsed is None:
            return None
        manifest = self.manifest_path(parsed)
        if not manifest.is_file():
            manifest = self.manifest_path(ModelName.parse(text.lower()))
            if not manifest.is_file():
                return None
        try:
            layers = {layer["mediaType"]: layer["digest"]
                      for layer in json.loads(manifest.read_text())["layers"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{manifest}: unreadable Ollama manifest: {e}") from e
        if MEDIA + "model" not in layers:
            raise ModelFormatError(f"{manifest}: an Ollama manifest without a model layer")
        gguf = self._blob(manifest, layers[MEDIA + "model"])
        if not is_gguf_file(gguf):
            raise ModelFormatError(f"{gguf}: the model layer of {manifest} is not a GGUF file")
        texts = {kind: self._text(manifest, layers[MEDIA + kind])
                 for kind in ("template", "params", "system") if MEDIA + kind in layers}
        try:
            params = json.loads(texts.get("params") or "{}")
        except ValueError as e:
            raise ModelFormatError(f"{manifest}: its params layer is not JSON: {e}") from e
        return OllamaModel(name=parsed, gguf=gguf, template=texts.get("template"),
                           params=params if isinstance(params, dict) else {},
                           system=texts.get("system"))

    def _blob(self, manifest: Path, digest: str) -> Path:
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ModelFormatError(f"{manifest}: layer digest {str(digest)[:80]!r} is not "
                                   "sha256:<64 hex digits>")
        blob = self.root / "blobs" / digest.replace(":", "-")
        if not blob.is_file():
            raise ModelNotFoundError(f"{manifest} names {digest}, but {blob} is missing; "
                                     "`ollama pull` the model again")
        return blob

    def _text(self, manifest: Path, digest: str) -> str:
        try:
            return self._blob(manifest, digest).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"{manifest}: unreadable layer {digest}: {e}") from e
