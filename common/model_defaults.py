"""A model's own defaults for the requests it serves: default options and a default system
prompt, as Ollama keeps them in a model's `params` and `system` layers (common/ollama_store.py).

Ollama's rule, kept here: a request's options are laid over the model's, which are laid over
the server's defaults (server/routes.go modelOptions: DefaultOptions, then model.Options, then
the request's), so a request that names an option always wins and one that leaves it out gets
the model's value. A JSON null in the request means "not given" (the model's value stays), as
it means the default in SamplingParams. The system prompt is the chat's first message when
the chat has no system message of its own, and /api/generate's system unless the request sends
one (Ollama's ChatHandler and GenerateHandler).

Invariant: `options` holds only option names tandem reads, each value checked by
SamplingParams' own rules when the model was loaded, so a merged request can fail only on what
the request itself sent. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from common.errors import InvalidOptionError, ModelFormatError
from common.sampling_params import OPTION_NAMES, SamplingParams


@dataclass(frozen=True)
class ModelDefaults:
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    system: str | None = None

    @classmethod
    def from_layers(cls, params: Mapping[str, Any], system: str | None, source: str,
                    warn: Callable[[str], None] | None = None) -> ModelDefaults:
        """From an Ollama model's params (JSON object) and system layers. Options tandem does
        not read (mirostat, num_gpu, ...) are left out, each reported through `warn`; a value
        SamplingParams refuses is a ModelFormatError naming `source` (the manifest)."""
        kept = {}
        for key, value in params.items():
            if key not in OPTION_NAMES:
                if warn is not None:
                    warn(f"{source}: model option {key!r} is not one tandem reads; ignored")
            elif value is not None:
                kept[key] = value
        try:
            SamplingParams.from_options(kept)
        except InvalidOptionError as exc:
            raise ModelFormatError(f"{source}: the model's default options are refused: "
                                   f"{exc}") from None
        return cls(MappingProxyType(kept), system or None)

    def __bool__(self) -> bool:
        return bool(self.options) or self.system is not None

    def options_under(self, request: Any) -> Any:
        """The request's options over the model's. Anything but an object is returned as sent,
        for SamplingParams.from_options to refuse in its own words."""
        if request is None:
            return dict(self.options)
        if not isinstance(request, Mapping):
            return request
        return {**self.options, **{k: v for k, v in request.items() if v is not None}}

    def with_system(self, messages: list[dict]) -> list[dict]:
        """A chat's messages with the model's system prompt first, unless the chat opens with a
        system message of its own (or is empty: a load request)."""
        if self.system is None or not messages or messages[0].get("role") == "system":
            return messages
        return [{"role": "system", "content": self.system}, *messages]

    def parameter_items(self) -> list[tuple[str, Any]]:
        """(name, value) per Modelfile PARAMETER line: a list option once per item."""
        return [(key, item) for key, value in self.options.items()
                for item in (value if isinstance(value, (list, tuple)) else [value])]
