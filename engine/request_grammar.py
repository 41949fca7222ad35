"""One request's grammar state: its llguidance matcher, how much of its output the matcher has
consumed, and the stop tokens it ends on. Built by engine/grammar.py's GrammarBackend, held on
the Request, and caught up before every mask (the invariant is in engine/grammar.py). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class GrammarError(ValueError):
    """A grammar that does not compile, or output it refuses (the request ends with an error)."""


class RequestGrammar:
    """One request's matcher, how much of its output it has consumed (the invariant above),
    and the stop tokens it ends on."""

    def __init__(self, matcher: Any, stops: frozenset[int], vocab_stops: frozenset[int]) -> None:
        self.matcher = matcher
        self.accepted = 0
        self.stops = stops  # the tokens that end this request
        self.ended = False  # the grammar has taken a stop token: nothing may follow
        self._vocab_stops = vocab_stops  # llguidance's EOS set
        self.own_stops = stops != vocab_stops  # the mask swaps llguidance's set for `stops`

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        for i in range(self.accepted, len(output_token_ids)):
            token = output_token_ids[i]
            if self.ended:
                ok = False
            elif token in self.stops and token not in self._vocab_stops:
                ok = self.ended = self.matcher.is_accepting()  # the request's own end
            else:
                ok = self.matcher.consume_token(token)
                self.ended = ok and token in self._vocab_stops
            if not ok:
                raise GrammarError(f"output token {token} (position {i}) does not match the "
                                   "request's grammar")
            self.accepted = i + 1
