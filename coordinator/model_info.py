"""What /api/tags, /api/show, /api/ps, /v1/models and the gRPC ListModels say about the served
model, computed once from its file(s) and config (no weights are read)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common.gguf_metadata import is_gguf_file
from coordinator.model import ServedModel
from coordinator.tool_calls import supports_tools

# Ollama writes a far-future expiry for a model kept loaded forever (keep_alive -1).
NEVER_EXPIRES = "2318-01-01T00:00:00Z"
_GGUF_QUANT = re.compile(r"\.(Q\d_[0-9A-Z_]+|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    size: int  # bytes on disk
    digest: str
    format: str  # "gguf" | "safetensors"
    family: str
    parameter_count: int
    quantization_level: str
    context_length: int
    modified_at: str  # ISO 8601, UTC

    @property
    def parameter_size(self) -> str:
        n = self.parameter_count
        return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family], "parameter_size": self.parameter_size,
                "quantization_level": self.quantization_level}


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def _parameter_count(model: ServedModel) -> int:
    c = model.config
    attention = c.hidden_size * (c.q_size * 2 + c.kv_size * 2)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * (attention + mlp + 2 * c.hidden_size) + embeddings + c.hidden_size


def describe(model: ServedModel) -> ModelInfo:
    files = _files(model.path)
    mtime = max(f.stat().st_mtime for f in files)
    is_gguf = model.path.is_file() and is_gguf_file(model.path)
    quant = _GGUF_QUANT.search(model.path.stem) if is_gguf else None
    return ModelInfo(
        name=model.listed_name, size=sum(f.stat().st_size for f in files),
        # Not the fingerprint itself: that is what a worker shows to register.
        digest=hashlib.sha256(f"tandem-digest:{model.fingerprint}".encode()).hexdigest(),
        format="gguf" if is_gguf else "safetensors",
        family=model.config.architecture, parameter_count=_parameter_count(model),
        quantization_level=quant.group(1).upper() if quant else ("unknown" if is_gguf else "F32"),
        context_length=model.context_len,
        modified_at=datetime.fromtimestamp(mtime, timezone.utc).isoformat())


def tags_entry(info: ModelInfo) -> dict[str, Any]:
    return {"name": info.name, "model": info.name, "modified_at": info.modified_at,
            "size": info.size, "digest": info.digest, "details": info.details()}


def ps_entry(info: ModelInfo, expires_at: str | None = None) -> dict[str, Any]:
    """expires_at: when keep_alive unloads the model (UTC ISO 8601); None = never."""
    # size_vram: tandem's workers may sit on other hosts; the coordinator does not know their
    # device memory, so it reports 0 rather than a guess.
    return {"name": info.name, "model": info.name, "size": info.size, "digest": info.digest,
            "details": info.details(), "expires_at": expires_at or NEVER_EXPIRES, "size_vram": 0,
            "context_length": info.context_length}


def public_name(model: ServedModel) -> str:
    """The model's name as clients know it; its file name where that name is a path."""
    return model.path.name if Path(model.name).expanduser().is_absolute() else model.listed_name


def _go_value(value: Any) -> str:
    """A parameter's value as Ollama's /api/show writes it (Go's %#v of the JSON value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value)


def show_body(model: ServedModel, info: ModelInfo) -> dict[str, Any]:
    c = model.config
    arch = info.family
    template = model.tokenizer.chat_template or ""
    # The model's default options (an Ollama params layer) as Ollama's /api/show lists them;
    # without any, the stop tokens the model ends on.
    items = model.defaults.parameter_items() or [
        ("stop", s) for s in sorted(model.tokenizer.id_to_token(t)
                                    for t in model.tokenizer.stop_token_ids)]
    parameters = "\n".join(f"{key:<30} {_go_value(value)}" for key, value in items)
    system = model.defaults.system
    # "tools" only for a template that reads `tools` (coordinator/tool_calls.py), as Ollama.
    capabilities = ["completion"] + (["tools"] if supports_tools(template) else [])
    return {
        "license": "",
        # FROM names the model as clients know it, never the server's file path.
        "modelfile": f"# Modelfile generated by tandem\nFROM {public_name(model)}\n"
                     + (f'SYSTEM """{system}"""\n' if system is not None else "")
                     + "".join(f"PARAMETER {key} {value}\n" for key, value in items),
        "parameters": parameters,
        **({"system": system} if system is not None else {}),
        "template": template,
        "details": info.details(),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": info.parameter_count,
            f"{arch}.context_length": c.max_position,
            f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.feed_forward_length": c.intermediate_size,
            f"{arch}.block_count": c.num_layers,
            f"{arch}.attention.head_count": c.num_heads,
            f"{arch}.attention.head_count_kv": c.num_kv_heads,
            f"{arch}.vocab_size": c.vocab_size,
        },
        "capabilities": capabilities,
        "modified_at": info.modified_at,
    }
