"""The words a semantic response-cache hit must agree on, beside the embedding's cosine.

A chat model's embedding of a short question (coordinator/response_cache.py: the served
model's last position under PromptEOL) weighs the question's shape far above the one word
that makes it another question: on the default model, "What is 12 times 8?" is nearer "What
is 12 times 7?" (cosine 0.9996) than most paraphrases are to each other, and 7 of 15
questions that differ in one common word ("the currency of France" / "the capital") were
answered at the 0.98 threshold. A wrong answer served is worse than a miss (a miss only costs
the compute the cache would have saved), so a hit must also pass two rules on the words:

    literals    the same numbers and names (digits; capitalized words not starting a
                sentence), as a multiset: "12 times 8" is not "12 times 7", "Germany" not
                "France"
    no swap     the two turns' content words (lowercased, plural -s folded, function words
                left out) may differ only one way: one turn may add words ("Which city is the
                capital of France?" / "What is the capital of France?"), but when each has a
                word the other lacks ("currency" / "capital", "ocean" / "desert"), one was
                put in the other's place: another question. A negation on one side only
                ("not", "never", "without", n't) is always another question.

What it costs: paraphrases that swap a word for a synonym ("the sea" / "the ocean", "compose"
/ "write") miss. Measured on benchmarks/bench_semantic_cache.py's probes (README, Response
cache). English rules: in a script without case no word is a name, and in another language
its function words count as content words, so the rules only get stricter there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"\d+(?:[.,:]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)?")
_SENTENCE_END = ".!?\n"
# Words that shape a question without naming what it asks about (English).
_FUNCTION_WORDS = frozenset("""
    a an the this that these those some any each every all both either neither
    i me my mine we us our you your yours he him his she her it its they them their
    what what's whats which who whom whose where when why how
    is are was were be been being am do does did done has have had having
    can could will would shall should may might must
    of in into on onto at to from by with for about as than then so and or but if
    there here please just also very really much many more most
""".split())
_NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "without", "except",
                        "neither", "nor", "cannot"})


def literals(text: str) -> tuple[str, ...]:
    """The numbers and names of a turn, sorted: every run of digits (12, 3.5, 1,000, 3:30) and
    every capitalized word that does not start a sentence (France, Alice, II; not "I")."""
    found = []
    for m in _WORD.finditer(text):
        word = m.group()
        if word[0].isdigit():
            found.append(word)
            continue
        word = word.split("'")[0]  # France's, I'm
        before = text[:m.start()].rstrip()
        starts = not before or before[-1] in _SENTENCE_END
        if word[0].isupper() and not starts and word != "I":
            found.append(word)
    return tuple(sorted(found))


def _fold(word: str) -> str:
    """Lowercase, 's and n't dropped, a plural -s / -ies folded (spiders -> spider, cities ->
    city; not glass, bus, Celsius, this)."""
    word = word.lower()
    if word.endswith("n't"):
        return "not"
    word = word.split("'")[0]  # 's, 'm, 're, 've, 'll, 'd
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def content_words(text: str) -> frozenset[str]:
    """The turn's words without its numbers and function words, folded (_fold)."""
    words = (_fold(m.group()) for m in _WORD.finditer(text) if not m.group()[0].isdigit())
    return frozenset(w for w in words if w not in _FUNCTION_WORDS)


@dataclass(frozen=True)
class TurnTerms:
    """What a turn's words say, for the rules in the module docstring."""
    literals: tuple[str, ...] = ()
    words: frozenset[str] = frozenset()

    @classmethod
    def of(cls, text: str) -> TurnTerms:
        return cls(literals(text), content_words(text))

    def same_question(self, other: TurnTerms) -> bool:
        """Whether the rules let a hit between the two turns stand (the cosine decides)."""
        if self.literals != other.literals:
            return False
        mine, theirs = self.words - other.words, other.words - self.words
        if (mine | theirs) & _NEGATIONS:
            return False
        return not (mine and theirs)
