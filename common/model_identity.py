"""A model's identity as one string, so that workers serving different models (or different
files of one model) refuse to pair. Torch-free: the coordinator computes it too.

The fingerprint covers the architecture and shapes, and the weight files' names, sizes and the
hash of their first and last MiB: cheap on multi-GB files, and any re-quantization or different
checkpoint changes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

from common.model_config import ModelConfig

_EDGE = 1 << 20


def _file_digest(path: Path, h: "hashlib._Hash") -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
            h.update(f.read(_EDGE))


def model_fingerprint(path: str | Path, config: ModelConfig) -> str:
    path = Path(path)
    h = hashlib.sha256(repr(sorted(asdict(config).items())).encode())
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    for f in files:
        _file_digest(f, h)
    return f"{config.name}-{h.hexdigest()[:16]}"
