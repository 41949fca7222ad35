"""Loading a speculative decoding draft model (--speculative draft:MODEL) beside its target."""

from __future__ import annotations

from pathlib import Path

import torch

from common.malloc_policy import loading_weights
from common.model_config import ModelConfig
from engine.draft_proposer import check_same_vocabulary
from engine.models import model_class


def load_draft(name: str, target_path: Path, target: ModelConfig, weight_format: str,
                device: torch.device):
    """The draft model `name` (resolved as --model is: a store name or a path), in the
    engine's own weight format (a decode engine's decode format) on its device. ValueError
    naming it when it cannot be found or read, or when its vocabulary is not the target's
    (size, and a few token strings where both tokenizers load)."""
    from common.model_store import default_store
    from common.tokenizer import Tokenizer
    from engine.loaders import load_model

    try:
        draft_path = default_store().resolve(name)
        loaded = load_model(Path(draft_path))
    except Exception as exc:  # noqa: BLE001 - re-raised naming the flag's model
        raise ValueError(f"--speculative draft:{name}: cannot load the draft model: {exc}") from exc
    try:
        target_tok, draft_tok = Tokenizer.from_path(target_path), Tokenizer.from_path(Path(draft_path))
    except Exception:  # noqa: BLE001 - a model without tokenizer files: sizes are compared alone
        target_tok = draft_tok = None
    try:
        check_same_vocabulary(target.vocab_size, loaded.config.vocab_size, target_tok, draft_tok)
    except ValueError as exc:
        raise ValueError(f"--speculative draft:{name}: {exc}") from None
    with loading_weights():
        model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, weight_format,
                                                        device=device)
        loaded.drop_resident_pages()
    return model
