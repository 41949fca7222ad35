"""Prompt lookup: draft tokens copied from a request's own prompt + output. Torch-free.

For a sequence t[0..L), try suffix lengths n = max..min: if t[L-n:L] occurred earlier, ending
just before position j < L, the draft is what followed it, t[j], t[j+1], ... Past the end of
the sequence the copy continues from its own draft (t[L+i] = t[j+i]: the repetition of period
L - j goes on), so a run of one repeated token drafts k tokens too.

Each request keeps an incremental index (NgramIndex): for each n, n-gram -> the position right
after its latest occurrence. Appending a token indexes one n-gram per n, so a step costs O(n
range) dictionary operations whatever the context length; the prompt is indexed once, at the
request's first proposal.

Adaptive k (engine/draft_length.py): a workload with nothing to copy drafts nothing but a
one-token probe every few steps, so it runs nearly as plain decoding while a copy that starts
later is still found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from engine.draft_length import PROBE_INTERVAL, DraftLength
from engine.proposer import Draft

if TYPE_CHECKING:
    from engine.request import Request

__all__ = ["PROBE_INTERVAL", "DraftState", "NgramIndex", "NgramProposer"]


class NgramIndex:
    """The n-grams of one growing token sequence, n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # _follow[n - min_n]: n-gram -> j, where t[j-n:j] is that n-gram (its latest
        # occurrence with a follower, so j < the length indexed).
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self._indexed = 0  # followers t[j] for j < _indexed are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        """Indexes `tokens` (the same sequence as before, possibly longer). Invariant kept:
        every position min_n <= j < len(tokens) is a follower in the index; len(tokens) is
        not (it has no token yet), so a match always lies strictly before the suffix."""
        for j in range(max(self._indexed, self.min_n), len(tokens)):
            for n, table in zip(range(self.min_n, self.max_n + 1), self._follow):
                if j >= n:
                    table[tuple(tokens[j - n:j])] = j
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens for `tokens` (already extend-ed), longest match first; [] when
        no suffix of min_n..max_n tokens occurred before."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            j = self._follow[n - self.min_n].get(tuple(tokens[length - n:length]))
            if j is None:
                continue
            draft: list[int] = []
            for i in range(k):  # past the end, the copy repeats itself (module docstring)
                pos = j + i
                draft.append(tokens[pos] if pos < length else draft[pos - length])
            return draft
        return []


@dataclass
class DraftState(DraftLength):
    """One request's proposer state: its n-gram index and its adaptive draft length."""

    index: NgramIndex = field(kw_only=True)


@dataclass
class NgramProposer:
    """Drafts for the requests of one engine; per-request state lives here, keyed by id."""

    k: int
    min_n: int = 1
    max_n: int = 3
    states: dict[str, DraftState] = field(default_factory=dict)
    cost_ratio: float = 1.0  # a drafted step's cost over a plain one (SpeculativeDecoder sets it)

    def propose_drafts(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, Draft]:
        """The Proposer contract (engine/proposer.py): one lookup per request."""
        drafts = {}
        for request, limit in wanted:
            ratio = self.cost_ratio if request.sampling_params.greedy else 1.0
            tokens = self.propose(request.request_id, request.token_ids, limit, ratio)
            if tokens:
                drafts[request.request_id] = Draft(tokens)
        return drafts

    def propose(self, request_id: str, tokens: Sequence[int], limit: int,
                cost_ratio: float = 1.0) -> list[int]:
        """At most min(adaptive k, limit) draft tokens for `tokens` (the request's prompt +
        output so far)."""
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = DraftState(index=NgramIndex(self.min_n, self.max_n))
        state.index.extend(tokens)
        length = min(state.draft_length(self.k, cost_ratio), limit)
        if length <= 0:
            return []
        return state.index.propose(tokens, length)

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        state = self.states.get(request_id)
        if state is not None:
            state.record(proposed, accepted)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
