"""The rules on a turn's words that a semantic response-cache hit must pass
(coordinator/turn_terms.py), on the cases they exist for and on the ones they let through."""

from __future__ import annotations

import pytest

from coordinator.turn_terms import TurnTerms, content_words, literals


@pytest.mark.parametrize("text, found", [
    ("What is 12 times 7?", ("12", "7")),
    ("What year did World War II end?", ("II", "War", "World")),
    ("How do I make pancakes? Paris is nice.", ()),  # "I", and sentence starts, are no names
    ("Who wrote 'Romeo and Juliet'?", ("Juliet", "Romeo")),
    ("Convert 1,000.5 km at 3:30", ("1,000.5", "3:30")),
    ("Is it France's capital? I'm not sure", ("France",)),  # 's and I'm are no names of their own
])
def test_literals_are_numbers_and_names(text, found):
    assert literals(text) == found


@pytest.mark.parametrize("text, words", [
    ("What is the capital of France?", {"capital", "france"}),
    ("What's the capital of France?", {"capital", "france"}),
    ("How many legs do spiders have?", {"leg", "spider"}),  # plurals folded
    ("Which cities are in Spain's north?", {"city", "spain", "north"}),
    ("What is the boiling point of water in Celsius?", {"boiling", "point", "water", "celsius"}),
    ("Don't add the glass", {"not", "add", "glass"}),  # n't is a negation; glass keeps its s
    ("What is 12 times 7?", {"time"}),  # numbers are literals, not words
])
def test_content_words_drop_function_words_and_fold_plurals(text, words):
    assert content_words(text) == frozenset(words)


@pytest.mark.parametrize("cached, asked, same", [
    ("What is the capital of France?", "What's the capital of France?", True),
    ("What is the capital of France?", "Which city is the capital of France?", True),  # a word added
    ("How many legs does a spider have?", "How many legs do spiders have?", True),
    ("What is the capital of France?", "What is the currency of France?", False),  # a swap
    ("Write a haiku about the ocean.", "Write a haiku about the desert.", False),
    ("Sort 5, 3, 9 in ascending order.", "Sort 5, 3, 9 in descending order.", False),
    ("What is 12 times 7?", "What is 12 times 8?", False),  # another number
    ("What is the capital of France?", "What is the capital of Germany?", False),  # another name
    ("Which animals are mammals?", "Which animals are not mammals?", False),  # a negation added
    ("Can I swim after eating?", "Can't I swim after eating?", False),
    ("Write a haiku about the ocean.", "Write a haiku about the sea.", False),  # the price: synonyms
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", True),  # let through
])
def test_a_hit_needs_the_same_literals_and_no_swapped_or_negated_word(cached, asked, same):
    a, b = TurnTerms.of(cached), TurnTerms.of(asked)
    assert a.same_question(b) is same
    assert b.same_question(a) is same  # symmetric: the order of asking changes nothing
