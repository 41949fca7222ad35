"""Prompt lookup: the incremental n-gram index against a brute-force search, the periodic copy,
and the adaptive draft length."""

from __future__ import annotations

import random

from engine.ngram_proposer import PROBE_INTERVAL, DraftState, NgramIndex, NgramProposer


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition: the longest suffix of hi..lo tokens seen before (latest occurrence),
    followed by what came after it, continued periodically past the end."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n:]
        for j in range(length - 1, n - 1, -1):
            if tokens[j - n:j] == suffix:
                ext = list(tokens)
                while len(ext) < j + k:
                    ext.append(ext[len(ext) - (length - j)])
                return ext[j:j + k]
    return []


def test_longest_suffix_wins_and_the_copy_follows_it():
    tokens = [5, 1, 2, 9, 8, 3, 1, 2, 7, 6, 0, 3, 1, 2]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    # "3 1 2" occurred at 5..7, followed by 7 6 0 3; "1 2" alone (latest at 6..7) agrees.
    assert index.propose(tokens, 4) == [7, 6, 0, 3]
    assert index.propose(tokens, 2) == [7, 6]


def test_a_repeated_token_drafts_k_tokens_by_the_periodic_copy():
    tokens = [4, 9, 9]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.propose(tokens, 5) == [9, 9, 9, 9, 9]
    tokens = [1, 2, 3, 1, 2, 3, 1]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.propose(tokens, 6) == [2, 3, 1, 2, 3, 1]


def test_no_match_proposes_nothing():
    tokens = list(range(10))
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.propose(tokens, 4) == []
    index = NgramIndex(2, 3)  # a single-token match is not enough here
    tokens = [1, 2, 3, 4, 2]
    index.extend(tokens)
    assert index.propose(tokens, 4) == []


def test_incremental_index_equals_the_brute_force_search():
    rng = random.Random(0)
    for lo, hi in ((1, 3), (2, 4), (1, 1)):
        tokens = [rng.randrange(6) for _ in range(5)]
        index = NgramIndex(lo, hi)
        for _ in range(150):
            index.extend(tokens)
            k = rng.randrange(1, 6)
            assert index.propose(tokens, k) == brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)
            tokens.append(rng.randrange(6))


def test_draft_length_falls_with_acceptance_and_probes_when_it_is_zero():
    state = DraftState(index=NgramIndex(1, 3))
    assert state.draft_length(4) == 4  # optimistic at first
    for _ in range(10):
        state.record(4, 0)
    assert state.draft_length(4) == 0
    lengths = [state.draft_length(4) for _ in range(3 * PROBE_INTERVAL)]
    assert lengths.count(1) == 3 and set(lengths) == {0, 1}
    for _ in range(10):  # the probes get accepted: the draft grows back
        state.record(1, 1)
    assert state.draft_length(4) == 4


def test_proposer_caps_the_draft_and_forgets_finished_requests():
    proposer = NgramProposer(k=4)
    tokens = [1, 2, 3, 1, 2, 3, 1]
    assert proposer.propose("a", tokens, limit=2) == [2, 3]
    assert proposer.propose("a", tokens, limit=0) == []
    proposer.record("a", 2, 0)
    assert proposer.states["a"].acceptance < 1.0
    proposer.forget("a")
    assert "a" not in proposer.states
