"""Draft verification: greedy acceptance, and speculative rejection sampling's output
distribution against the target's on a fixed small distribution (fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from engine.rejection_sampler import accept_greedy, rejection_sample
from engine.sampler import NO_TOKEN


def test_accept_greedy():
    assert accept_greedy([3, 4, 5], [3, 4]) == [3, 4, 5]  # all accepted + the bonus token
    assert accept_greedy([3, 9, 5], [3, 4]) == [3, 9]  # the target's token at the mismatch
    assert accept_greedy([8, 4, 5], [3, 4]) == [8]
    assert accept_greedy([3, NO_TOKEN, 5], [3, 4]) == [3]  # row 1 has no token: stop short
    assert accept_greedy([NO_TOKEN, 4, 5], [3, 4]) == []
    with pytest.raises(ValueError, match="need 3 target rows"):
        accept_greedy([3, 4], [3, 4])


P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


def frequencies(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab).double() / len(draws)


@pytest.mark.parametrize("draft_token", [0, 1, 4])
def test_first_emitted_token_follows_the_target_whatever_the_draft(draft_token):
    # One draft token; row 0's distribution is P. The first token of the run must be
    # distributed as P; whether the draft is likely (0) or not (4) changes only how often
    # it is accepted (with probability P[draft]).
    gen = torch.Generator().manual_seed(1234)
    probs = torch.stack([P, P])
    n = 6000
    runs = [rejection_sample(probs, [draft_token], [gen, gen]) for _ in range(n)]
    first = frequencies([r[0] for r in runs], 5)
    assert torch.allclose(first, P.double(), atol=0.025), first
    accepted = sum(len(r) == 2 for r in runs) / n
    assert abs(accepted - P[draft_token].item()) < 0.025
    # Chi-square of the first token against P (4 degrees of freedom: 99.9% quantile 18.5).
    chi2 = float(((first - P.double()) ** 2 / P.double()).sum() * n)
    assert chi2 < 18.5


def test_tokens_after_an_accepted_draft_follow_their_own_row():
    q = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6])
    gen = torch.Generator().manual_seed(7)
    probs = torch.stack([P, q])
    runs = [rejection_sample(probs, [0], [gen, gen]) for _ in range(8000)]
    seconds = [r[1] for r in runs if len(r) == 2]
    assert torch.allclose(frequencies(seconds, 5), q.double(), atol=0.03)


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never():
    gen = torch.Generator().manual_seed(0)
    sure = torch.tensor([0.0, 1.0, 0.0])
    for _ in range(200):
        assert rejection_sample(torch.stack([sure, sure]), [1], [gen, gen]) == [1, 1]
    never = torch.tensor([0.0, 0.5, 0.5])
    for _ in range(200):
        run = rejection_sample(torch.stack([never, never]), [0], [gen, gen])
        assert len(run) == 1 and run[0] in (1, 2)


def test_seeded_generators_reproduce_the_run_and_bad_rows_stop_it():
    probs = torch.stack([P, P, P, P])
    make = lambda: [torch.Generator().manual_seed(100 + i) for i in range(4)]  # noqa: E731
    runs = {tuple(rejection_sample(probs, [0, 1, 0], make())) for _ in range(5)}
    assert len(runs) == 1
    nan = torch.stack([P, torch.full((5,), float("nan")), P])
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        run = rejection_sample(nan, [0, 0], [gen] * 3)
        assert len(run) == 1  # row 1 has no distribution: the run ends after row 0's token
    with pytest.raises(ValueError, match="3 probability rows"):
        rejection_sample(probs, [0, 1], [gen] * 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_sample(torch.stack([P, P]), [9], [gen] * 2)
