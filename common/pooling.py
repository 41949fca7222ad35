"""How an embedding input's hidden states become one vector (engine/embedding.py says why each).

Torch-free: the coordinator parses a request's `pooling` with `Pooling.parse` before anything
is queued, so a bad value is a 400 naming the field; the worker protocol carries the choice as
an enum (worker.proto EmbedRequest.pooling, MEAN = 0 so that an old caller means mean).
"""

from __future__ import annotations

from enum import Enum


class Pooling(str, Enum):
    MEAN = "mean"  # every position's final normed hidden state, averaged (the default)
    LAST = "last"  # the last position's: the only one that saw the whole input (causal)

    @classmethod
    def parse(cls, value: object, field: str = "pooling") -> Pooling:
        """A client's value as a Pooling; ValueError naming `field` and the choices else."""
        if isinstance(value, str):
            for pooling in cls:
                if value == pooling.value:
                    return pooling
        raise ValueError(f"{field} must be one of {', '.join(repr(p.value) for p in cls)}, "
                         f"got {value!r}")

    @property
    def wire(self) -> int:
        """Its worker.proto enum number."""
        return list(Pooling).index(self)

    @classmethod
    def from_wire(cls, number: int) -> Pooling:
        """ValueError for a number no Pooling has (a forged or newer caller)."""
        members = list(cls)
        if not 0 <= number < len(members):
            raise ValueError(f"unknown pooling {number}")
        return members[number]
