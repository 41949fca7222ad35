"""Token ids -> client text for one request: incremental detokenization (never half a UTF-8
character) followed by stop strings (never any part of one). Synchronous and pure; the caller
ends the request when `push` reports a stop."""

from __future__ import annotations

from collections.abc import Sequence

from common.detokenizer import IncrementalDetokenizer
from common.stop_strings import StopStringMatcher
from common.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._stops = StopStringMatcher(stop) if stop else None

    @property
    def stopped(self) -> bool:
        return self._stops is not None and self._stops.stopped

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """(text to send now, whether a stop string was hit: the request must end)."""
        text = "".join(self._detok.push(t) for t in token_ids)
        if self._stops is None:
            return text, False
        return self._stops.feed(text)

    def finish(self) -> str:
        """Text held back at the natural end of the request ("" after a stop string)."""
        if self.stopped:
            return ""
        text = self._detok.flush()
        if self._stops is None:
            return text
        text, stopped = self._stops.feed(text)
        return text if stopped else text + self._stops.flush()
