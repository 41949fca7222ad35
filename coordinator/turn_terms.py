"""The words a semantic response-cache hit must agree on, beside the embedding's cosine.

A chat model's embedding of a short question (coordinator/response_cache.py: the served
model's last position under PromptEOL) weighs the question's shape far above the words that
make it another question: on the default model, "What is 12 times 8?" is nearer "What is 12
times 7?" (cosine 0.9996) than most paraphrases are to each other, "the capital of France"
and "its currency" sit at 0.98, and a word added ("an egg" / "an egg white", 0.996) or
swapped ("my name" / "your name", 0.996) barely moves it. A wrong answer served is worse
than a miss (a miss only costs the compute the cache would have saved), so a hit must also
pass two rules on the words:

    literals    the same numbers and names (digits; capitalized words not starting a
                sentence), in the same order: "12 times 8" is not "12 times 7", "7 minus 12"
                not "12 minus 7", "from English to French" not "from French to English"
    words       the same words in the same order, once each is lowercased, its plural folded
                (spiders -> spider), a contraction split off (what's -> what, isn't -> not),
                and articles, present-tense "be"/"do" and "please" left out as carrying
                nothing; so an added word ("the first capital"), a swapped one ("currency",
                "least", "your", "why"), a negation, a preposition ("to Paris" / "from
                Paris") or a reordering ("10 miles to kilometers" / "10 kilometers to miles",
                "Is a dolphin a fish?" / "Is a fish a dolphin?") makes another question

What passes: the same question in other punctuation, articles, contractions, plurals or case
of common words ("How many legs do spiders have?" / "how many legs does a spider have"). What
misses: the same question in other words or another order ("the sea" / "the ocean"): with a
chat model's embedding the cosine cannot tell those from near-misses, so the semantic mode
answers, in effect, the same words asked again (a dedicated embedding model would be what
widens it). English rules: in a script without case no word is a name,
and another language's function words count as content words, so they only get stricter.
README, Response cache: the figures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"\d+(?:[.,:]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)*")
_SENTENCE_END = ".!?\n"
_APOSTROPHES = str.maketrans({c: "'" for c in "\u2019\u2018\u02bc\u2032\uff07"})
# English contractions' endings, split off a word ('s also the possessive); anything else
# after an apostrophe is part of the word (O'Brien, o'clock).
_ENDINGS = ("'s", "'m", "'re", "'ve", "'ll", "'d")
# Words that carry nothing a question could turn on (English): the rest are content words.
_FILLER = frozenset("a an the is are am be do does please".split())
# One interrogative asked two ways.
_SAME_WORD = {"which": "what", "whats": "what"}


def _base(word: str) -> tuple[str, bool]:
    """(the word without a contraction's ending, whether that ending was n't)."""
    lower = word.lower()
    if lower.endswith("n't"):
        return word[:-3], True
    for ending in _ENDINGS:
        if lower.endswith(ending):
            return word[:-len(ending)], False
    return word, False


def literals(text: str) -> tuple[str, ...]:
    """The numbers and names of a turn, in order: every run of digits (12, 3.5, 1,000, 3:30)
    and every capitalized word that does not start a sentence (France, Alice, II, O'Brien;
    not "I"). One pass: what precedes a word is the gap since the last one."""
    text = text.translate(_APOSTROPHES)
    found, last_end = [], 0
    for m in _WORD.finditer(text):
        word = m.group()
        gap = text[last_end:m.start()].rstrip()
        starts = (gap[-1] in _SENTENCE_END) if gap else last_end == 0
        last_end = m.end()
        if word[0].isdigit():
            found.append(word)
            continue
        word = _base(word)[0]
        if word and word[0].isupper() and not starts and word != "I":
            found.append(word)
    return tuple(found)


def _fold(word: str) -> list[str]:
    """A word as content words: lowercased, a contraction's ending split off (n't as "not"),
    a plural -s / -ies folded (spiders -> spider, cities -> city; not glass, bus, Celsius)."""
    base, negated = _base(word.lower())
    if base == "cannot":
        base, negated = "can", True
    elif negated and base in ("ca", "wo"):  # can't, won't
        base = {"ca": "can", "wo": "will"}[base]
    tail = ["not"] if negated else []
    if base in _FILLER:
        return tail
    if len(base) > 4 and base.endswith("ies"):
        base = base[:-3] + "y"
    elif len(base) > 3 and base.endswith("s") and not base.endswith(("ss", "us", "is")):
        base = base[:-1]
    return [_SAME_WORD.get(base, base), *tail] if base else tail


def content_words(text: str) -> tuple[str, ...]:
    """The turn's words but its numbers and fillers, folded (_fold), in order."""
    text = text.translate(_APOSTROPHES)
    return tuple(w for m in _WORD.finditer(text) if not m.group()[0].isdigit()
                 for w in _fold(m.group()))


@dataclass(frozen=True)
class TurnTerms:
    """What a turn's words say, for the rules in the module docstring."""
    literals: tuple[str, ...] = ()
    words: tuple[str, ...] = ()

    @classmethod
    def of(cls, text: str) -> TurnTerms:
        return cls(literals(text), content_words(text))

    def same_question(self, other: TurnTerms) -> bool:
        """Whether the rules let a hit between the two turns stand (the cosine decides)."""
        return self.literals == other.literals and self.words == other.words
