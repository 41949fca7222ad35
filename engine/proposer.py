"""The proposer contract: what speculative decoding asks of whatever drafts tokens.

SpeculativeDecoder (engine/speculative.py) holds one proposer and calls it on the engine
thread only:

    propose_drafts(wanted) once per step, before the schedule, with every request that may
                           speculate and the most tokens it may draft; returns a Draft for
                           some of them (a request left out, or given [], decodes plainly)
    record(id, k, accepted)  after each verification of that request's draft
    cost_ratio             an attribute the decoder sets before each propose: what a step
                           with drafts costs over a plain one (engine/draft_length.py)
    forget(id)             when the request finishes, is aborted or leaves (migrates): the
                           proposer frees everything it holds for it; unknown ids are a no-op

A proposer never touches the target's KV blocks or the request's tokens: the scheduler
allocates the draft slots, the verification decides what is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from engine.request import Request


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # proposed to follow the request's token_ids, in order
    # [len(token_ids), V]: row i is the distribution token_ids[i] was drawn from (a draft
    # model sampling for a sampled request). None: a point mass on each token (prompt lookup,
    # or a greedy draft for a greedy request), which the rejection sampler treats as one-hot.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    cost_ratio: float

    def propose_drafts(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, Draft]: ...

    def record(self, request_id: str, proposed: int, accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...
