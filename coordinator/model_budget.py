"""How many models, and how many bytes of their weights, may be loaded at once when models
are loaded on request (coordinator/on_demand.py), and which to unload to make room.

A model's cost is the size of its weight files (model_bytes: the GGUF file, or a Hugging Face
directory's safetensors/bin files), what its workers map; the KV pools and the engines' packed
copies come on top, so a budget is a bound on the weights, not on the host's memory. Every
loaded model counts, those served from the start (pinned: never unloaded for room) and those
loading right now included, so that two first requests for two models cannot together pass
the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from coordinator.admission import Overloaded

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def parse_size(text: str) -> int:
    """"8GB", "512MiB", "1.5G", "123456" as bytes (decimal units, binary with "i"); a
    ValueError naming the value otherwise."""
    match = _SIZE.fullmatch(str(text).strip())
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit such as "
                         "8GB or 512MiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return value


def model_bytes(path: Path) -> int:
    """The bytes of a model's weights: a file's size, or a directory's weight files'."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def shown_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class ModelBudgetExceeded(Overloaded):
    """A model cannot be loaded now: the budget is spent by models in use (HTTP 503, with
    Retry-After: it may fit once one of them is idle)."""


@dataclass(frozen=True)
class Loaded:
    """A loaded (or loading) model as the budget sees it."""

    key: str  # the model's fingerprint
    name: str
    size: int  # model_bytes
    last_used: float  # monotonic; the least recent is unloaded first
    evictable: bool  # loaded on request, started and with no request in flight or queued


@dataclass(frozen=True)
class ModelBudget:
    max_models: int | None = None  # most models loaded at once (None: no bound)
    max_bytes: int | None = None  # most bytes of weights loaded at once (None: no bound)
    retry_after_s: int = 5

    def __post_init__(self) -> None:
        if self.max_models is not None and self.max_models < 1:
            raise ValueError(f"the most loaded models must be >= 1, got {self.max_models}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"a memory budget must be >= 1 byte, got {self.max_bytes}")

    def describe(self) -> str:
        parts = ([f"at most {self.max_models} model(s)"] if self.max_models else []) + (
            [f"{shown_bytes(self.max_bytes)} of weights"] if self.max_bytes else [])
        return ", ".join(parts) or "no bound"

    def to_unload(self, name: str, size: int, loaded: list[Loaded]) -> list[Loaded]:
        """The models to unload, least recently used first, so that `name` (`size` bytes)
        fits beside the rest; ModelBudgetExceeded when it cannot, naming the budget."""
        if self.max_bytes is not None and size > self.max_bytes:
            raise ModelBudgetExceeded(
                f"model '{name}' ({shown_bytes(size)} of weights) is larger than the model "
                f"memory budget of {shown_bytes(self.max_bytes)} (tandem serve "
                "--model-memory-budget)", self.retry_after_s)
        chosen: list[Loaded] = []
        kept = list(loaded)
        for candidate in sorted((m for m in loaded if m.evictable), key=lambda m: m.last_used):
            if self._fits(size, kept):
                break
            chosen.append(candidate)
            kept.remove(candidate)
        if not self._fits(size, kept):
            busy = ", ".join(f"{m.name} ({shown_bytes(m.size)})" for m in kept)
            raise ModelBudgetExceeded(
                f"model '{name}' ({shown_bytes(size)}) does not fit the loaded-model budget "
                f"({self.describe()}; tandem serve --max-loaded-models, --model-memory-budget) "
                f"beside the models in use or served from the start: {busy}; retry once one "
                "is idle", self.retry_after_s)
        return chosen

    def _fits(self, size: int, loaded: list[Loaded]) -> bool:
        if self.max_models is not None and len(loaded) + 1 > self.max_models:
            return False
        return self.max_bytes is None or sum(m.size for m in loaded) + size <= self.max_bytes
