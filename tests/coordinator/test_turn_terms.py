"""The rules on a turn's words that a semantic response-cache hit must pass
(coordinator/turn_terms.py): the cases they exist for, including the near-misses a review
found the embedding answers (cosines on the default model in the module docstring), and
what they let through."""

from __future__ import annotations

import pytest

from coordinator.turn_terms import TurnTerms, content_words, literals


@pytest.mark.parametrize("text, found", [
    ("What is 12 times 7?", ("12", "7")),
    ("What is 7 minus 12?", ("7", "12")),  # in order
    ("What year did World War II end?", ("World", "War", "II")),
    ("How do I make pancakes? Paris is nice.", ()),  # "I", and sentence starts, are no names
    ("Who wrote 'Romeo and Juliet'?", ("Romeo", "Juliet")),
    ("Convert 1,000.5 km at 3:30", ("1,000.5", "3:30")),
    ("Is it France's capital? I'm not sure", ("France",)),  # 's and I'm are no names of their own
    ("Call Mr O'Brien, not O’Neill", ("Mr", "O'Brien", "O'Neill")),  # curly apostrophe too
])
def test_literals_are_numbers_and_names_in_order(text, found):
    assert literals(text) == found


@pytest.mark.parametrize("text, words", [
    ("What is the capital of France?", ("what", "capital", "of", "france")),
    ("What's the capital of France?", ("what", "capital", "of", "france")),
    ("How many legs do spiders have?", ("how", "many", "leg", "spider", "have")),  # plurals
    ("how many legs does a spider have", ("how", "many", "leg", "spider", "have")),
    ("Which cities are in Spain's north?", ("what", "city", "in", "spain", "north")),
    ("Why isn’t the glass full?", ("why", "not", "glass", "full")),  # curly n't; glass keeps s
    ("I can't, you cannot, it won't", ("i", "can", "not", "you", "can", "not", "it", "will", "not")),
    ("What is 12 times 7?", ("what", "time")),  # numbers are literals, not words
])
def test_content_words_drop_fillers_fold_plurals_and_split_contractions(text, words):
    assert content_words(text) == words


@pytest.mark.parametrize("cached, asked, same", [
    ("What is the capital of France?", "What's the capital of France?", True),
    ("How many legs does a spider have?", "how many legs do spiders have", True),
    ("Who wrote Romeo and Juliet?", "Who wrote 'Romeo and Juliet'?", True),
    ("What is the capital of France?", "What is the currency of France?", False),  # a swap
    ("Write a haiku about the ocean.", "Write a haiku about the desert.", False),
    ("What is 12 times 7?", "What is 12 times 8?", False),  # another number
    ("What is the capital of France?", "What is the capital of Germany?", False),  # another name
    ("What is the capital of France?", "Which city is the capital of France?", False),  # added
    ("How many calories are in an egg?", "How many calories are in an egg white?", False),
    ("Who was the president in 1990?", "Who was the vice president in 1990?", False),
    ("What is the most populous country?", "What is the least populous country?", False),
    ("What is my name?", "What is your name?", False),
    ("When did World War II end?", "Why did World War II end?", False),
    ("Which animals are mammals?", "Which animals are not mammals?", False),  # a negation
    ("Why is the sky blue?", "Why isn’t the sky blue?", False),  # ... with a curly apostrophe
    ("Can I take ibuprofen?", "Can’t I take ibuprofen?", False),
    ("Flights to Paris", "Flights from Paris", False),  # a preposition
    ("What is 7 minus 12?", "What is 12 minus 7?", False),  # reordered numbers
    ("Translate it from English to French.", "Translate it from French to English.", False),
    ("Is a dolphin a fish?", "Is a fish a dolphin?", False),  # reordered words
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", False),
    ("Call Mr O'Brien at noon.", "Call Mr O'Neill at noon.", False),
    ("Write a haiku about the ocean.", "Write a haiku about the sea.", False),  # the price: synonyms
])
def test_a_hit_needs_the_same_literals_and_the_same_words_in_order(cached, asked, same):
    a, b = TurnTerms.of(cached), TurnTerms.of(asked)
    assert a.same_question(b) is same
    assert b.same_question(a) is same  # symmetric: the order of asking changes nothing


def test_literals_in_one_pass_agree_with_reading_each_words_whole_prefix():
    """literals() finds what precedes a word in the gap since the last one (one pass over a
    turn that may be 500 KB); the plain rule reads the whole prefix before each word."""
    import random
    import re

    from coordinator.turn_terms import _APOSTROPHES, _WORD, _base

    def plain(text: str) -> tuple[str, ...]:
        text, found = text.translate(_APOSTROPHES), []
        for m in _WORD.finditer(text):
            word, before = m.group(), text[:m.start()].rstrip()
            starts = not before or before[-1] in ".!?\n"
            if word[0].isdigit():
                found.append(word)
            elif (w := _base(word)[0]) and w[0].isupper() and not starts and w != "I":
                found.append(w)
        return tuple(found)

    rng = random.Random(7)
    pieces = ["Paris", "is", "I", "I'm", "O'Brien", "12", "3.5", " ", "  ", ". ", "? ", "!", "\n",
              ",", "'", "’", "\"", "x", "Y", "n't", "’s", "--"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert literals(text) == plain(text), text
    assert re.fullmatch(r"[a-z]+", "".join(content_words("ab " * 1000)))
