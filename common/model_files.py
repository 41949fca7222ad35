"""What a model path is, and its config from metadata alone (no tensor data is read). Torch-free:
the coordinator and the launchers call it; engine/loaders reads the weights.

    model_format(path) -> "gguf" | "hf"
    load_config(path)  -> ModelConfig
"""

from __future__ import annotations

from pathlib import Path

from common.errors import ModelFormatError, ModelNotFoundError
from common.gguf_metadata import gguf_header_config, read_gguf_header
from common.hf_config import read_hf_config
from common.model_config import ModelConfig


def model_format(path: str | Path) -> str:
    """'gguf' or 'hf' for an existing model path; ModelNotFoundError / ModelFormatError else."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFormatError(f"{path}: directory has no config.json, so it is not a "
                                   "Hugging Face model directory")
        return "hf"
    return "gguf"  # any other file: the GGUF reader checks the magic and names the problem


def load_config(path: str | Path) -> ModelConfig:
    """The model's config from metadata alone (no tensor data is read). Torch-free."""
    path = Path(path).expanduser()
    if model_format(path) == "gguf":
        return gguf_header_config(read_gguf_header(path), name=path.stem)
    return read_hf_config(path)
