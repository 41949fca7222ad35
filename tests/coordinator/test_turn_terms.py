"""The rules on a turn's words that a semantic response-cache hit must pass
(coordinator/turn_terms.py): the cases they exist for, among them the near-misses two
reviews found the default model's embedding answers (cosines in the module docstring), and
what they let through."""

from __future__ import annotations

import random

import pytest

from coordinator.turn_terms import _APOSTROPHES, _TOKEN, TurnTerms, content_words, literals


@pytest.mark.parametrize("text, found", [
    ("What is 12 times 7?", ("12", "7")),
    ("What is 7 minus 12?", ("7", "12")),  # in order
    ("What year did World War II end?", ("World", "War", "II")),
    ("How do I make pancakes? Paris is nice.", ()),  # "I", and sentence starts, are no names
    ("Who wrote 'Romeo and Juliet'?", ("Romeo", "Juliet")),
    ("Convert 1,000.5 km at 3:30", ("1,000.5", "3:30")),
    ("Is it France's capital? I'm not sure", ("France",)),  # 's and I'm are no names of their own
    ("Call Mr O'Brien, not O’Neill", ("Mr", "O'Brien", "O'Neill")),  # curly apostrophe too
    ("Is 5 + 3 > -2 in C++, or 50%?", ("5", "+", "3", ">", "-", "2", "C", "++", "50", "%")),
    ("£100 or €100 at UTC-5", ("£", "100", "€", "100", "UTC", "-", "5")),
    ("line one\nParis is here", ()),  # a new line starts a sentence
])
def test_literals_are_numbers_names_and_symbols_in_order(text, found):
    assert literals(text) == found


@pytest.mark.parametrize("text, words", [
    ("What is the capital of France?", ("what", "is", "the", "capital", "of", "france")),
    ("What's the capital of France?", ("what", "is", "the", "capital", "of", "france")),
    ("how many legs does a spider have", ("how", "many", "legs", "does", "a", "spider", "have")),
    ("France's capital, please", ("france's", "capital")),  # a possessive stays as written
    ("Why isn’t the glass full?", ("why", "is", "not", "the", "glass", "full")),  # curly n't
    ("I can't, you cannot, it won't, we'll, they're", (
        "i", "can", "not", "you", "can", "not", "it", "will", "not", "we", "will", "they", "are")),
    ("Where'd it go?", ("where'd", "it", "go")),  # 'd: would, had or did; kept as written
    ("Define 'please'", ("define", "please")),  # a quoted word counts as written
    ("What is 12 times 7?", ("what", "is", "times")),  # numbers are literals, not words
])
def test_content_words_are_the_words_written_out_in_order(text, words):
    assert content_words(text) == words


@pytest.mark.parametrize("cached, asked, same", [
    ("What is the capital of France?", "What's the capital of France?", True),
    ("How many legs does a spider have?", "how many legs does a spider have", True),
    ("Who wrote Romeo and Juliet?", "Who wrote 'Romeo and Juliet'?", True),
    ("Please translate hello to French.", "Translate hello to French", True),
    ("Why is the sky not blue?", "Why is the sky not blue", True),
    ("What is the capital of France?", "What is the currency of France?", False),  # a swap
    ("What is 12 times 7?", "What is 12 times 8?", False),  # another number
    ("What is the capital of France?", "What is the capital of Germany?", False),  # another name
    ("How many calories are in an egg?", "How many calories are in an egg white?", False),
    ("Who was the president in 1990?", "Who was the vice president in 1990?", False),
    ("What is the most populous country?", "What is the least populous country?", False),
    ("What is my name?", "What is your name?", False),
    ("When did World War II end?", "Why did World War II end?", False),
    ("Why is the sky blue?", "Why isn’t the sky blue?", False),  # a negation, curly apostrophe
    ("Flights to Paris", "Flights from Paris", False),  # a preposition
    ("What is 7 minus 12?", "What is 12 minus 7?", False),  # reordered numbers
    ("Translate it from English to French.", "Translate it from French to English.", False),
    ("Is a dolphin a fish?", "Is a fish a dolphin?", False),  # reordered words
    ("Call Mr O'Brien at noon.", "Call Mr O'Neill at noon.", False),
    ("What is 5 + 3?", "What is 5 - 3?", False),  # symbols
    ("How do I reverse a list in C++?", "How do I reverse a list in C#?", False),
    ("How much is £100 in US dollars?", "How much is €100 in US dollars?", False),
    ("What is -5 squared?", "What is 5 squared?", False),
    ("What's the meaning of the word 'the'?", "What's the meaning of the word 'a'?", False),
    ("What does a CPU do?", "What is a CPU?", False),  # do and does are words too
    ("Where'd it go?", "Where does it go?", False),
    ("Do I need a visa for Japan?", "I need a visa for Japan.", False),
    ("What's new?", "What's the news?", False),  # no plural folding: news is not new
    ("Who is a doctor here?", "Who is the doctor here?", False),  # articles are words
    ("Write a haiku about the ocean.", "Write a haiku about the sea.", False),  # the price
    ("How many legs does a spider have?", "How many legs do spiders have?", False),  # ... too
])
def test_a_hit_needs_the_same_literals_and_the_same_words_in_order(cached, asked, same):
    a, b = TurnTerms.of(cached), TurnTerms.of(asked)
    assert a.same_question(b) is same
    assert b.same_question(a) is same  # symmetric: the order of asking changes nothing


def test_literals_in_one_pass_agree_with_reading_each_tokens_whole_prefix():
    """_tokens finds what precedes a token in the gap since the last one (one pass over a
    turn that may be 500 KB); the plain rule reads the whole prefix before each token."""
    def plain(text: str) -> tuple[str, ...]:
        text, found = text.translate(_APOSTROPHES), []
        for m in _TOKEN.finditer(text):
            token, before = m.group(), text[:m.start()].rstrip(" \t")
            starts = not before or before[-1] in ".!?\n"
            if token[0].isdigit() or not (token[0].isalnum() or token[0] == "_"):
                found.append(token)
                continue
            name = token[:-2] if token.endswith("'s") else token
            if name[0].isupper() and not starts and name != "I":
                found.append(name)
        return tuple(found)

    rng = random.Random(7)
    pieces = ["Paris", "is", "I", "I'm", "O'Brien", "France's", "12", "3.5", " ", "  ", ". ",
              "? ", "!", "\n", ",", "'", "’", "\"", "“", "x", "Y", "n't", "’s", "--", "+", "£", "\t"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert literals(text) == plain(text), repr(text)
