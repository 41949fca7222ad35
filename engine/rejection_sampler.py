"""Verification of a draft against the target model's distributions at each draft position.

A request with draft d[0..k) gets k + 1 target rows from one forward pass over
[last token, d0, ..., d(k-1)]: row i is the target's distribution for the token after
d[0..i). The result is a run: the accepted draft prefix followed by one token of the target's
own, so every step emits at least one token.

Greedy: accept d[i] while it equals the target's choice at row i; the run's last token is the
target's choice at the first mismatch (or row k after a full accept). That is exactly the
sequence non-speculative greedy decoding produces from the same logits.

Sampled (Leviathan et al. / Chen et al. speculative sampling): accept d[i] with probability
min(1, p(d[i]) / q(d[i])); on a reject draw from the residual max(0, p - q), normalized.
Each emitted token is then distributed as p, whatever the draft. q is the draft's
distribution at row i: a draft model's (draft_probs, engine/draft_proposer.py), or, when
none is given, n-gram's point mass q = one-hot(d[i]), where the test is u < p(d[i]) and the
residual is p with d[i]'s mass removed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.sampler import NO_TOKEN


def accept_greedy(targets: Sequence[int], draft: Sequence[int]) -> list[int]:
    """targets: the target's choice at rows 0..k (NO_TOKEN: that row has none). The run of
    accepted drafts plus the target's token; a run ends early, without a token of its own,
    where a row has none (the last accepted draft is then the target's choice at the row
    before; an empty run means the first row failed)."""
    if len(targets) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} target rows, "
                         f"got {len(targets)}")
    run: list[int] = []
    for i, token in enumerate(targets):
        if token == NO_TOKEN:
            return run
        if i == len(draft) or token != draft[i]:
            run.append(token)
            return run
        run.append(token)
    return run


def rejection_sample(probs: torch.Tensor, draft: Sequence[int],
                     generators: Sequence[torch.Generator | None],
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs [k + 1, V]: the target's sampling distribution at each row (filters and
    temperature applied, rows summing to 1); generators: one per row (a seeded request's
    position generators, or the same unseeded generator k + 1 times); draft_probs [k, V]:
    the distribution each draft token was drawn from, None for a point-mass draft. Returns
    the run (module docstring); it stops short, without a token of its own, at a row that
    has no valid distribution."""
    k = len(draft)
    if probs.dim() != 2 or probs.shape[0] != k + 1 or len(generators) != k + 1:
        raise ValueError(f"{k} draft tokens need {k + 1} probability rows and generators, got "
                         f"{tuple(probs.shape)} and {len(generators)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, probs.shape[1]):
        raise ValueError(f"{k} draft tokens need draft probabilities of shape "
                         f"{(k, probs.shape[1])}, got {tuple(draft_probs.shape)}")
    usable = (probs.isfinite().all(-1) & (probs.sum(-1) > 0)).tolist()
    run: list[int] = []
    for i in range(k + 1):
        if not usable[i]:
            return run
        p = probs[i]
        gen = generators[i]
        if i == k:
            run.append(_draw(p, gen))
            return run
        token = draft[i]
        if not 0 <= token < p.shape[0]:
            raise ValueError(f"draft token {token} is outside the vocabulary (0..{p.shape[0] - 1})")
        u = torch.rand((), generator=gen, device=_device(gen)).item()
        if draft_probs is None:
            if u < p[token].item():
                run.append(token)
                continue
            # Rejected: the residual max(0, p - onehot) is p without the draft's mass. Its sum
            # is 1 - p(token) > u >= 0, so it has mass left.
            residual = p.clone()
            residual[token] = 0.0
        else:
            q = draft_probs[i].to(p.device, p.dtype)
            # u < min(1, p/q) without dividing: q(token) > 0 since the draft drew it.
            if u * q[token].item() < p[token].item():
                run.append(token)
                continue
            # Rejected means p(token) < q(token), so p - q is positive somewhere (both sum
            # to 1) and the residual has mass; rounding can still leave none when p and q are
            # equal to within float error, and then p itself is the right law.
            residual = (p - q).clamp_min(0.0)
            if not residual.sum().item() > 0:
                residual = p
        run.append(_draw(residual, gen))
        return run
    return run


def _device(gen: torch.Generator | None) -> torch.device:
    return gen.device if gen is not None else torch.device("cpu")


def _draw(p: torch.Tensor, gen: torch.Generator | None) -> int:
    # multinomial normalizes its input; a generator lives on one device, so the row goes there.
    return int(torch.multinomial(p.to(_device(gen)), 1, generator=gen))
