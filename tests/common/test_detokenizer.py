"""Streaming output: the incremental detokenizer and the stop-string matcher."""

from __future__ import annotations

import random

import pytest

from common.detokenizer import IncrementalDetokenizer
from common.errors import InvalidOptionError
from common.stop_strings import StopStringMatcher
from common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


def _stream(tokenizer, ids, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.model
def test_stream_equals_full_decode_on_fuzz_corpus(smollm, tokenizer_oracle):
    for row in tokenizer_oracle:
        pieces = _stream(smollm, row["ids"])
        assert "".join(pieces) == smollm.decode(row["ids"], skip_special_tokens=True)
        # Valid text never streams a replacement character: split characters are held back whole.
        if "\ufffd" not in row["text"]:
            assert not any("\ufffd" in p for p in pieces), row["text"]


@pytest.mark.model
def test_split_multibyte_character_is_held_back(smollm):
    ids = smollm.encode("a😀b", add_special_tokens=False)
    emoji_ids = ids[1:-1]
    assert len(emoji_ids) > 1  # the emoji spans several byte-level tokens
    pieces = _stream(smollm, ids)
    assert pieces[0] == "a"
    assert pieces[1 : len(emoji_ids)] == [""] * (len(emoji_ids) - 1)
    assert pieces[len(emoji_ids)] == "😀"
    assert "".join(pieces) == "a😀b"


@pytest.mark.model
def test_flush_drops_an_incomplete_character(smollm):
    ids = smollm.encode("a😀", add_special_tokens=False)[:-1]  # cut mid-character
    pieces = _stream(smollm, ids)
    assert smollm.decode(ids).endswith("\ufffd")
    assert "".join(pieces) == "a"


@pytest.mark.model
def test_special_tokens_skipped_or_kept(smollm):
    ids = smollm.encode("Hi there<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(smollm, ids)) == "Hi there"
    assert "".join(_stream(smollm, ids, skip_special_tokens=False)) == "Hi there<|im_end|>"


@pytest.mark.model
def test_window_stays_short(smollm):
    ids = smollm.encode("word " * 300, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm)
    out = []
    for i in ids:
        out.append(detok.push(i))
        assert len(detok._window) <= 2  # only the last emitted token is kept as context
    assert "".join(out) + detok.flush() == "word " * 300


def _sentencepiece_tokenizer() -> Tokenizer:
    """A SentencePiece vocab, whose decoder drops the leading space: spacing depends on context."""
    words = ["▁Hello", "▁world"]
    pieces = ["▁", "H", "e", "l", "o", "w", "r", "d", "!", *(w[:n] for w in words for n in range(2, len(w) + 1))]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
        }
    )


def test_spacing_across_tokens_sentencepiece():
    tok = _sentencepiece_tokenizer()
    ids = tok.encode("Hello world! 模", add_special_tokens=True)
    pieces = _stream(tok, ids)
    # Decoding "▁world" alone would give "world"; the window keeps the space.
    assert pieces[:4] == ["", "Hello", " world", "!"]
    assert "".join(pieces) == "Hello world! 模" == tok.decode(ids, skip_special_tokens=True)
    # 模 is three byte-fallback tokens: nothing until the last one.
    assert pieces[-4:] == ["", "", "模", ""]


def _byte_level_tokenizer() -> Tokenizer:
    """GPT-2 byte-level BPE with no merges: one token per byte (id == byte), then <|endoftext|>."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    names = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    return Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": [names[b] for b in range(256)] + ["<|endoftext|>"],
            "tokenizer.ggml.token_type": [1] * 256 + [3],
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 256,
        }
    )


@pytest.mark.parametrize("char", ["é", "模", "😀", "\u0800", "\ud7ff", "\U00100000"])
def test_cut_character_is_dropped_not_replaced_byte_level(char):
    tok = _byte_level_tokenizer()
    ids = tok.encode("a" + char, add_special_tokens=False)
    assert ids == [0x61, *char.encode()]
    for cut in range(2, len(ids)):  # after "a" and one or more of the character's bytes
        assert tok.decode(ids[:cut]).endswith("\ufffd")
        assert "".join(_stream(tok, ids[:cut])) == "a", (char, cut)
    assert "".join(_stream(tok, ids)) == "a" + char


def test_cut_character_is_dropped_sentencepiece_byte_fallback():
    tok = _sentencepiece_tokenizer()
    ids = tok.encode("Hello 模", add_special_tokens=False)
    for cut in (1, 2):  # 模 is three byte tokens; the decoder writes one U+FFFD per byte held
        pieces = _stream(tok, ids[: len(ids) - 3 + cut])
        assert "".join(pieces) == "Hello "


@pytest.mark.parametrize("ids, text", [
    ([0x61, 0xFF], "a\ufffd"),          # never valid in UTF-8
    ([0x61, 0x80], "a\ufffd"),          # a continuation byte with no lead
    ([0x61, 0xFF, 0x62], "a\ufffdb"),   # invalid in the middle
    ([0x61, 0xE6, 0x62], "a\ufffdb"),   # a lead byte cut short by another character
    ([0x61, 0xE6, 0x62, 0xE6], "a\ufffdb"),  # ... and a cut character at the end
])
def test_invalid_bytes_still_replaced(ids, text):
    assert "".join(_stream(_byte_level_tokenizer(), ids)) == text


# ---- stop strings --------------------------------------------------------------------------------------


def _feed_all(matcher, chunks):
    out, stopped = [], False
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return out, stopped


def test_stop_string_spanning_tokens_is_never_emitted():
    out, stopped = _feed_all(StopStringMatcher(["<|end|>"]), ["Hello <", "|e", "nd", "|> more"])
    assert stopped
    assert out == ["Hello ", "", "", ""]


def test_partial_prefix_held_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P!") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ORM") == ("STORM", False)
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_multiple_stops_earliest_wins():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    m = StopStringMatcher(["\n\n", "User:"])
    assert _feed_all(m, ["Answer", ".\n", "User", ":"]) == (["Answer", ".", "\n", ""], True)


def test_overlapping_prefixes_hold_the_longest_candidate():
    m = StopStringMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)
    assert m.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert m.feed("b") == ("", True)


def test_after_stop_everything_is_dropped():
    m = StopStringMatcher(["x"])
    assert m.feed("ax") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


class _FindEverywhere:
    """The obvious matcher, as a reference: find every stop string in the held text plus the
    new text (cost grows with the number of stop strings), hold the longest tail that is a
    proper prefix of one."""

    def __init__(self, stops):
        self.stops, self.held, self.stopped = list(dict.fromkeys(stops)), "", False

    def feed(self, text):
        if self.stopped:
            return "", True
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)], True
        keep = max((n for s in self.stops for n in range(1, min(len(s) - 1, len(buf)) + 1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self):
        held, self.held = self.held, ""
        return "" if self.stopped else held


def test_the_automaton_equals_finding_every_stop_string():
    rng = random.Random(7)
    for _ in range(3000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 16)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) \
            if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        ours, ref = StopStringMatcher(stops), _FindEverywhere(stops)
        assert [ours.feed(p) for p in pieces] == [ref.feed(p) for p in pieces], (stops, pieces)
        assert ours.flush() == ref.flush()


def test_cost_per_character_does_not_grow_with_the_number_of_stop_strings(monkeypatch):
    """One automaton step per new character, whether there is one stop string or 256."""
    from common import stop_strings

    steps = []
    real_step = stop_strings._Automaton.step
    monkeypatch.setattr(stop_strings._Automaton, "step",
                        lambda self, state, ch: steps.append(ch) or real_step(self, state, ch))
    for stops in (["zz-end"], [f"stop-{i:04d}-end" for i in range(256)]):
        steps.clear()
        m = StopStringMatcher(stops)
        for _ in range(50):
            assert m.feed(" a token") == (" a token", False)
        assert len(steps) == 50 * len(" a token")
    assert m.feed("stop-0042-e")[1] is False and m.feed("nd!") == ("", True)


@pytest.mark.parametrize("stops", [[""], ["ok", ""], "STOP", [3]])
def test_bad_stop_lists_rejected(stops):
    with pytest.raises(InvalidOptionError):
        StopStringMatcher(stops)


@pytest.mark.model
def test_detokenizer_into_stop_matcher(smollm):
    ids = smollm.encode("The answer is 42.\nUser: next", add_special_tokens=False)
    detok, matcher = IncrementalDetokenizer(smollm), StopStringMatcher(["\nUser:"])
    emitted = []
    for i in ids:
        text, stopped = matcher.feed(detok.push(i))
        emitted.append(text)
        if stopped:
            break
    assert stopped and "".join(emitted) == "The answer is 42."
