"""Ollama's store and the Hugging Face hub cache, written on disk in their real layouts."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

GO_TEMPLATE = "{{ .System }}{{ .Prompt }}"
PARAMS = {"stop": ["<|im_end|>"], "temperature": 0.6}


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_ollama_store(root: Path, gguf: Path, name: str = "library/tiny", tag: str = "latest",
                      params: dict | None = None, system: str | None = "You are tiny.") -> Path:
    """Ollama's layout: a manifest naming digests, each layer a blob named by its digest.
    params: the params layer (PARAMS by default); system None: no system layer."""
    kinds = [("model", gguf.read_bytes()), ("template", GO_TEMPLATE.encode()),
             ("params", json.dumps(PARAMS if params is None else params).encode())]
    if system is not None:
        kinds.append(("system", system.encode()))
    layers = [{"mediaType": f"application/vnd.ollama.image.{kind}", **_blob(root, data)}
              for kind, data in kinds]
    manifest = root / "manifests" / "registry.ollama.ai" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   **_blob(root, b"{}")}, "layers": layers}))
    return root


def make_hf_cache(root: Path, repo: str, files: dict[str, Path], revision: str = "a" * 40) -> Path:
    """huggingface_hub's layout: files in blobs/ by hash, linked from snapshots/<rev>/."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(revision)
    (base / "blobs").mkdir(exist_ok=True)
    for rel, source in files.items():
        data = source.read_bytes()
        blob = base / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = base / "snapshots" / revision / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root
