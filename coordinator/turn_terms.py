"""The words a semantic response-cache hit must agree on, beside the embedding's cosine.

A chat model's embedding of a short question (coordinator/response_cache.py: the served
model's last position under PromptEOL) weighs the question's shape far above the words that
make it another question: on the default model, "What is 12 times 8?" is nearer "What is 12
times 7?" (cosine 0.9996) than most paraphrases are to each other, and a word added ("an
egg" / "an egg white", 0.996), swapped ("my name" / "your name", 0.996) or reordered ("7
minus 12" / "12 minus 7", 0.992) barely moves it. A wrong answer served is worse than a miss
(a miss only costs the compute the cache would have saved), so a hit must also pass two
rules on the turns' words (README, Response cache: the figures):

    literals    the same numbers, names and symbols, in the same order: digits (12, 3.5,
                1,000, 3:30), capitalized words not starting a sentence (France, II, O'Brien;
                not "I"), and runs of symbols (+ - * / ^ % < > = # $ £ € ...): "12 times 8"
                is not "12 times 7", "5 + 3" not "5 - 3", "C++" not "C#", "£100" not "€100"
    words       the same words in the same order, once case, punctuation and "please" are
                set aside and contractions are written out (what's -> what is, isn't -> is
                not, can't -> can not, 'll -> will); a word in quotes counts as written

So the same question asked again with other punctuation, contractions or case of its common
words hits ("What's the capital of France?" / "what is the capital of France"); one with an
added, dropped, swapped or reordered word misses, a paraphrase in other words included: with
a chat model's embedding the cosine cannot tell those from near-misses, so the semantic mode
answers, in effect, the same question asked again (an embedding model that separates them
would be what widens it). English rules: in a script without case no word is a name, so they
only get stricter there. With a dedicated embedding model
(`--response-cache semantic:model=NAME,threshold=T,match=literals`) the words rule can be left
to the model; the literals rule always holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A number, a word (apostrophes inside it: O'Brien, what's), or a run of symbols: anything
# but letters, digits, spaces, punctuation that ends or separates phrases, quotes, brackets.
_TOKEN = re.compile(r"\d+(?:[.,:]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)*|[^\w\s.,;:!?'\"()\[\]{}]+")
_SENTENCE_END = ".!?\n"
_QUOTES = "'\""
_APOSTROPHES = str.maketrans({c: "'" for c in "\u2019\u2018\u02bc\u2032\uff07"} |
                             {c: '"' for c in "\u201c\u201d\u201e\u00ab\u00bb"})
# 's is "is" after these (what's, it's), else a possessive (France's), kept as written.
_IS_BEFORE = frozenset("what who where when why how it that there here he she this".split())
_ENDINGS = {"'m": "am", "'re": "are", "'ve": "have", "'ll": "will"}
_NOT_BASE = {"ca": "can", "wo": "will", "sha": "shall"}  # can't, won't, shan't


def _symbols(token: str) -> bool:
    return not (token[0].isalnum() or token[0] == "_")


def _written_out(lower: str) -> list[str]:
    """A lowercased word with its contraction written out (module docstring)."""
    if lower == "cannot":
        return ["can", "not"]
    if lower.endswith("n't"):
        base = lower[:-3]
        return [_NOT_BASE.get(base, base), "not"] if base else ["not"]
    if lower.endswith("'s"):
        base = lower[:-2]
        return [base, "is"] if base in _IS_BEFORE else [lower]
    for ending, word in _ENDINGS.items():
        if lower.endswith(ending):
            return [lower[:-len(ending)], word]
    return [lower]


def _tokens(text: str):
    """(token, whether a sentence starts at it, whether a quote is right before it), in
    order, in one pass: what precedes a token is the gap since the last one."""
    text = text.translate(_APOSTROPHES)
    last_end = 0
    for m in _TOKEN.finditer(text):
        gap = text[last_end:m.start()]
        stripped = gap.rstrip(" \t")
        starts = (stripped[-1] in _SENTENCE_END) if stripped else last_end == 0
        quoted = bool(gap) and gap[-1] in _QUOTES
        last_end = m.end()
        yield m.group(), starts, quoted


def literals(text: str) -> tuple[str, ...]:
    """The numbers, names and symbol runs of a turn, in order (module docstring)."""
    found = []
    for token, starts, _ in _tokens(text):
        if token[0].isdigit() or _symbols(token):
            found.append(token)
            continue
        name = token[:-2] if token.endswith("'s") else token  # France's
        if name[0].isupper() and not starts and name != "I":
            found.append(name)
    return tuple(found)


def content_words(text: str) -> tuple[str, ...]:
    """The turn's words, lowercased and written out (module docstring), in order; "please"
    left out unless quoted."""
    words = []
    for token, _, quoted in _tokens(text):
        if token[0].isdigit() or _symbols(token):
            continue
        lower = token.lower()
        if quoted:
            words.append(lower)
        elif lower != "please":
            words.extend(_written_out(lower))
    return tuple(words)


@dataclass(frozen=True)
class TurnTerms:
    """What a turn's words say, for the rules in the module docstring."""
    literals: tuple[str, ...] = ()
    words: tuple[str, ...] = ()

    @classmethod
    def of(cls, text: str) -> TurnTerms:
        return cls(literals(text), content_words(text))

    def same_question(self, other: TurnTerms, words: bool = True) -> bool:
        """Whether the rules let a hit between the two turns stand (the cosine decides).
        words False: the literals rule only (`--response-cache semantic:...,match=literals`,
        for an embedding model that tells paraphrases from near-misses in other words)."""
        return self.literals == other.literals and (not words or self.words == other.words)
