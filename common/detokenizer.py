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

At the end (`flush`), held bytes that are only the start of a character (a generation cut by
num_predict mid-character) are dropped, as Ollama trims them; bytes that no continuation can
make valid (0xFF, a stray continuation byte) still decode to U+FFFD. The decoders give text,
not bytes, so the test is a probe: append continuation-byte tokens and see whether one
character completes; the text before that character is what the held ids say.
"""

from __future__ import annotations

from common.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# A byte token's name in each vocabulary kind: SentencePiece byte fallback, GPT-2 byte-level
# (bytes_to_unicode maps 0x80 and 0xA0 to U+0122 and U+0142).
_BYTE_TOKEN_NAMES = {0x80: ("<0x80>", "\u0122"), 0xA0: ("<0xA0>", "\u0142")}


class IncrementalDetokenizer:
    """Feed ids with `push`, one per generated token; call `flush` once at the end.

    Invariant: "".join(pushes) + flush() == tokenizer.decode(all_ids, skip_special_tokens), less
    the U+FFFD of an incomplete character at the very end.
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
        """Whatever is held back, less the bytes of a character that was cut short."""
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        if new_text.endswith(_REPLACEMENT):
            new_text = self._without_cut_character(new_text)
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def _without_cut_character(self, text: str) -> str:
        """`text` (the window's decode, ending in U+FFFD) without a trailing incomplete character.

        UTF-8 lets one or two continuation bytes after a lead byte be 0x80..0xBF, except that the
        first one after E0/F0 must be >= 0xA0/0x90 and after ED/F4 <= 0x9F/0x8F: so 0x80s, or 0xA0
        then 0x80s, complete every valid prefix of 1-3 bytes. If one completes a character, the
        text before it is the window's text without the cut bytes (however many U+FFFD the
        decoder wrote for them)."""
        low, high = (self._byte_token(b) for b in (0x80, 0xA0))
        if low is None or high is None:
            return text
        for first in (low, high):
            for extra in range(3):
                probed = self._decode([*self._window, first, *[low] * extra])
                if not probed.endswith(_REPLACEMENT) and len(probed) > 0:
                    return probed[:-1]
        return text  # genuinely invalid bytes: keep the replacement character

    def _byte_token(self, byte: int) -> int | None:
        """The id of the token that is exactly this one (continuation) byte, if the vocab has one."""
        for name in _BYTE_TOKEN_NAMES[byte]:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None and self._decode([token_id]) == _REPLACEMENT:
                return token_id
        return None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
