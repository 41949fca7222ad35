"""Stop strings over streamed text: stop at the first one, and never emit any part of it.

A stop string can arrive split across several tokens ("<|" then "end|>"), so the matcher holds
back the longest tail of the text that could still grow into a stop string, and releases it
once it can no longer match:

    fed so far:   "Hello <|en"        stops: ["<|end|>"]
    emitted:      "Hello "            held: "<|en"   (a prefix of "<|end|>")

Invariant: no emitted text is, or ends with, the start of a stop string, so a stop string
always lies wholly inside the held text plus what is fed next.

Cost. The stop strings are compiled once into an Aho-Corasick automaton (a trie of the stop
strings with failure links). Its state after any text is the longest tail of that text that is
a prefix of some stop string: exactly the held tail. So `feed` walks only the new characters,
one amortized transition each, whatever the number of stop strings: a request with thousands
of stop strings costs the event loop no more per token than one with a single stop string.
Building costs O(total characters), bounded by MAX_STOP_STRINGS x MAX_STOP_LENGTH
(common/sampling_params.py refuses more before any work starts).

Which stop wins: among the stop strings found in the held text plus the new text, the one that
starts earliest (the output ends before anything that stops it). Each automaton state records
the longest stop string ending there (a shorter one ending at the same place starts later), so
the earliest start is one comparison per character.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from common.errors import InvalidOptionError


class _Automaton:
    """Trie of the stop strings with failure links. State 0 is the root (the empty tail)."""

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]  # the length of the tail a state stands for
        ends = [0]  # the length of the stop string spelled by a state, 0 if none
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append(0)
                state = nxt
            ends[state] = depth[state]
        fail = [0] * len(goto)
        # longest[s]: the longest stop string that is a suffix of state s's tail (0 if none):
        # its own, else the one its failure state holds. Breadth-first, so a failure state
        # (always shallower) is final before it is read.
        longest = list(ends)
        queue = deque(goto[0].values())  # depth-1 states fail to the root
        while queue:
            state = queue.popleft()
            for ch, child in goto[state].items():
                queue.append(child)
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)
                longest[child] = longest[child] or longest[fail[child]]
        self.goto, self.depth, self.fail, self.longest = goto, depth, fail, longest

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


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
        self._automaton = _Automaton(tuple(dict.fromkeys(stops)))
        self._state = 0
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found). After a stop, ("", True)."""
        if self.stopped:
            return "", True
        buf = self._held + text
        automaton, state, first = self._automaton, self._state, len(buf)
        for i, ch in enumerate(text, start=len(self._held)):
            state = automaton.step(state, ch)
            length = automaton.longest[state]
            if length:
                first = min(first, i + 1 - length)
        if first < len(buf):
            self.stopped = True
            self._held = ""
            return buf[:first], True
        self._state = state
        keep = automaton.depth[state]  # the longest tail that is a proper prefix of a stop
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held tail, once the text has ended without a stop; "" after a stop."""
        held, self._held = self._held, ""
        self._state = 0
        return "" if self.stopped else held
