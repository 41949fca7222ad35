"""Token ids -> text, one token at a time, for streaming.

Decoding one token alone is wrong in two ways: a byte-level token may hold only part of a
multi-byte UTF-8 character (it decodes to U+FFFD until the rest arrives), and SentencePiece
decoders drop a leading space at the start of a decode. So each push decodes a short window
of recent ids twice, as vLLM and TGI do:

    ids:   ... | prefix_offset ........ read_offset ........ end |
                 '- already emitted -'  '- not yet emitted -'

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):] unless it ends in U+FFFD (a character still incomplete)

The emitted tokens stay in the window as context for the next decode; everything before
prefix_offset is dropped, so each push costs a few tokens of decoding, not the whole output.
"""

from __future__ import annotations

from common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed ids with `push`, one per generated token; call `flush` once at the end.

    Invariant: "".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._window: list[int] = []  # ids from prefix_offset on; earlier ones are no longer needed
        self._read_offset = 0  # index in _window of the first id whose text is not yet emitted

    def push(self, token_id: int) -> str:
        """The text that `token_id` makes printable; "" while a character is still incomplete."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Nothing printable yet (a special token skipped, or half a character): hold the ids.
            return ""
        # The ids already emitted become the context of the next decode; older ones are dropped.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes to U+FFFD, as a full decode does)."""
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
