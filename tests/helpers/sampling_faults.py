"""Faults in one request's sampling numbers, for the tests of the sampler, the engine and the
workers: sampling options past the range checks that every API applies, and a sampler that
poisons one request's logits."""

from __future__ import annotations

import dataclasses
import math

from engine.sampler import Sampler
from common.sampling_params import SamplingParams


def unchecked(params: SamplingParams | None = None, **values) -> SamplingParams:
    """A copy of `params` (default: the defaults) with `values` set past SamplingParams' range
    checks, as a direct caller could build them, so that what the test sees is the sampler's
    and the engine's own defence."""
    params = dataclasses.replace(params or SamplingParams())
    for name, value in values.items():
        object.__setattr__(params, name, value)
    return params


class PoisonedSampler(Sampler):
    """Gives the rows of one request (found by its params object) NaN logits once it has
    `after` output tokens, or with `raises`, raises on them as torch.multinomial would."""

    def __init__(self, poisoned: SamplingParams, prompt_len: int, after: int = 0,
                 raises: bool = False) -> None:
        self.poisoned, self.prompt_len, self.after, self.raises = poisoned, prompt_len, after, raises

    def sample(self, logits, params, token_histories, generators):
        logits = logits.clone()
        for i, (p, history) in enumerate(zip(params, token_histories)):
            if p is self.poisoned and len(history) - self.prompt_len >= self.after:
                if self.raises:
                    raise RuntimeError("probability tensor contains either inf, nan or element < 0")
                logits[i] = math.nan
        return super().sample(logits, params, token_histories, generators)
