"""Stop strings over streamed text: stop at the first one, and never emit any part of it.

A stop string can arrive split across several tokens ("<|" then "end|>"), so the matcher holds
back the longest tail of the text that could still grow into a stop string, and releases it
once it can no longer match:

    fed so far:   "Hello <|en"        stops: ["<|end|>"]
    emitted:      "Hello "            held: "<|en"   (a prefix of "<|end|>")

Invariant: no emitted text is, or ends with, the start of a stop string, so a stop string
always lies wholly inside the held text plus what is fed next.
"""

from __future__ import annotations

from typing import Sequence

from common.errors import InvalidOptionError


class StopStringMatcher:
    """Call `feed` with each new piece of text, then `flush` at the end if it never stopped."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise InvalidOptionError("stop must be a list of strings, not one string")
        stops = tuple(stops)
        if not all(isinstance(s, str) for s in stops):
            raise InvalidOptionError("stop must be a list of strings")
        if any(s == "" for s in stops):
            raise InvalidOptionError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))  # de-duplicated, order kept
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found). After a stop, ("", True)."""
        if self.stopped:
            return "", True
        buf = self._held + text
        # The earliest-starting stop string wins: the output ends before anything that stops it.
        hits = [i for i in (buf.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held tail, once the text has ended without a stop; "" after a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
