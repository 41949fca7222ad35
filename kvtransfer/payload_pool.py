"""Staging buffers for outgoing payloads, reused once the transport is done with them, and the
sender's flow control.

Why: a fresh 3 MiB tensor per unit (a 2,048-token layer of the default model) is a fresh
mmap, so every one of its pages faults on first touch; the gather into it then ran at a
fraction of copy speed. A sender's I/O thread takes a buffer here, fills it (gather and
crc32c in one pass, SenderHooks.gather_crc), hands it to zmq with copy=False and gives the
pool the send's MessageTracker: the buffer is handed out again only once the tracker says
libzmq released it (never while a frame may still read it).

Flow control: there are at most `keep` buffers. While all of them are in flight, take()
returns None and the sender leaves its next unit queued (SenderHooks._io_can_transmit), so a
sender that outruns its link holds `keep` payloads, not one per queued layer.

One pool per sender, touched by its I/O thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_KEEP = 4  # payloads in flight per sender: 4 x 3 MiB at 2,048 tokens of SmolLM2


class PayloadPool:
    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.keep = keep
        # [buffer (uint8), done(): True once nothing reads it]
        self._entries: list[list] = []

    def has_free(self) -> bool:
        return len(self._entries) < self.keep or any(done() for _, done in self._entries)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of at least nbytes that no send still reads (contents undefined), or
        None while `keep` buffers are in flight. Call sent() or release() with it next."""
        free = [entry for entry in self._entries if entry[1]()]
        fits = [entry for entry in free if entry[0].numel() >= nbytes]
        if fits:
            entry = min(fits, key=lambda e: e[0].numel())
        elif len(self._entries) < self.keep:
            entry = [None, _free]
            self._entries.append(entry)
        elif free:  # too small for this unit: replaced by one that fits
            entry = free[0]
        else:
            return None
        if entry[0] is None or entry[0].numel() < nbytes:
            entry[0] = torch.empty(nbytes, dtype=torch.uint8)
        entry[1] = _lent
        return entry[0]

    def sent(self, buffer: torch.Tensor, done: Callable[[], bool]) -> None:
        """`buffer`, taken from here, is being sent; done() is True once nothing reads it."""
        for entry in self._entries:
            if entry[0] is buffer:
                entry[1] = done
                return

    def release(self, buffer: torch.Tensor) -> None:
        """`buffer` was taken but not sent after all: free again."""
        self.sent(buffer, _free)

    def drop(self) -> None:
        """Forget every buffer (in-flight sends keep theirs alive through their frames)."""
        self._entries.clear()


def _lent() -> bool:
    return False  # taken and not yet sent: not free


def _free() -> bool:
    return True
