"""Token sampling with llama.cpp's (and so Ollama's) semantics, batched.

Per row, in this order:

    logit_bias (OpenAI's: each listed token's bias added to its logit)
    penalties (repeat / presence / frequency over the last repeat_last_n tokens of prompt+output)
    greedy rows (temperature 0 or top_k 1): argmax, done
    top_k -> typical_p -> top_p -> min_p      filters on untempered probabilities, min_keep = 1
    temperature -> softmax -> draw with the row's own generator

Every filter is computed for the whole batch at once from per-row parameter tensors (a row whose
setting is "off" keeps everything), so a batch costs a few full-width ops whatever its mix of
settings. Only the draw is per row: it uses the row's generator, so a seeded request gets the
same tokens whatever else shares its batch or where it sits in it. All arithmetic is fp32.

A row whose numbers leave nothing to draw from (NaN logits; probabilities that are not finite
or sum to zero, e.g. from a temperature that is 0 or inf once in fp32) gets NO_TOKEN instead of
a token. The sampler never raises for one row's values: the engine ends that request with an
error and the rest of the batch goes on.

Before the sampler the engine masks what a request may not emit next: its grammar's refusals
(engine/grammar.py) and, until min_tokens exist, its stop tokens (forbid_tokens).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Collection, Sequence

import numpy as np
import torch
from torch import Tensor

from common.sampling_params import SamplingParams

NO_TOKEN = -1  # in Sampler.sample's output: this row had no valid distribution


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request. `seed` None draws a fresh seed from the OS."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % (1 << 64))  # manual_seed takes [0, 2**64)
    return gen


def position_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for the token drawn at `position` of a seeded request.

    Seeding each draw from (seed, position) instead of advancing one generator per request
    makes a seeded request's tokens independent of where each draw happens: the same on one
    engine or split across a prefill worker (first token) and a decode worker (the rest),
    after a preemption, and whatever else shares the batch."""
    mixed = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return make_generator(int.from_bytes(mixed, "little"), device)


def greedy_tokens(logits: Tensor) -> Tensor:
    """[B, V] fp32 -> each row's argmax [B] int64 (the first of equal maxima), NO_TOKEN for a
    row with a NaN (argmax would pick it) or nothing above -inf (no token at all).
    On the CPU the argmax is numpy's: aten's ran ~2.7 ns an element on an AVX2 host (AMD EPYC
    Zen 3, one thread: 132 us for one row of SmolLM2's 49,152 logits, 0.92 ms for 8 rows;
    numpy's 10 and 75 us), and the NaN test rides on amax, which propagates a NaN (a separate
    isnan pass cost 120 us a row)."""
    top = logits.amax(-1)
    usable = top > -math.inf  # False for a NaN too
    if logits.device.type == "cpu":
        index = torch.from_numpy(logits.detach().numpy().argmax(-1).astype(np.int64, copy=False))
    else:
        index = logits.argmax(-1)
    return torch.where(usable, index, NO_TOKEN)


class Sampler:
    """Stateless; one per runner. Never modifies the logits it is given."""

    def sample(self, logits: Tensor, params: Sequence[SamplingParams],
               token_histories: Sequence[Sequence[int]],
               generators: Sequence[torch.Generator | None]) -> Tensor:
        """logits [B, V] fp32 -> token ids [B] int64, NO_TOKEN for a row with no valid
        distribution. `token_histories[i]` is row i's prompt followed by its output so far
        (only its tail is read, for penalties); a None generator draws from torch's global
        generator."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"logits must be [batch, vocab] float32, got "
                             f"{tuple(logits.shape)} {logits.dtype}")
        batch = logits.shape[0]
        if not len(params) == len(token_histories) == len(generators) == batch:
            raise ValueError(f"{batch} logit rows but {len(params)} params, "
                             f"{len(token_histories)} histories, {len(generators)} generators")
        if batch == 0:
            return torch.full((0,), NO_TOKEN, dtype=torch.int64, device=logits.device)
        logits = apply_penalties(apply_logit_bias(logits, params), params, token_histories)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == batch:  # the common batch: no copy of its rows
            return greedy_tokens(logits)
        out = torch.full((batch,), NO_TOKEN, dtype=torch.int64, device=logits.device)
        if greedy:
            rows = _index(greedy, logits.device)
            out[rows] = greedy_tokens(logits[rows])
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = _index(sampled, logits.device)
            probs = probabilities(logits[rows], [params[i] for i in sampled])
            # What torch.multinomial would refuse: a non-finite entry or no mass at all.
            usable = (probs.isfinite().all(-1) & (probs.sum(-1) > 0)).tolist()
            drawn = [(j, i) for j, i in enumerate(sampled) if usable[j]]
            if drawn:
                draws = [_draw(probs[j], generators[i]) for j, i in drawn]
                out[_index([i for _, i in drawn], logits.device)] = torch.stack(draws).to(logits.device)
        return out


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Adds each row's logit_bias; one scatter for the batch. Returns a new tensor when any row
    has a bias, else `logits` itself."""
    entries = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries)
    if max(tokens) >= logits.shape[1]:
        raise ValueError(f"logit_bias names token {max(tokens)}, outside [0, {logits.shape[1]})")
    device = logits.device
    result = logits.clone()
    result.index_put_((_index(list(rows), device), _index(list(tokens), device)),
                      torch.tensor(biases, dtype=torch.float32, device=device), accumulate=True)
    return result


def forbid_tokens(logits: Tensor, banned: Sequence[Collection[int]]) -> Tensor:
    """Row i's tokens banned[i] get -inf (ids past the vocabulary are skipped); one scatter for
    the batch. Returns a new tensor when anything is banned, else `logits` itself."""
    vocab = logits.shape[1]
    entries = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    if not entries:
        return logits
    rows, tokens = zip(*entries)
    result = logits.clone()
    result[_index(list(rows), logits.device), _index(list(tokens), logits.device)] = -math.inf
    return result


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams],
                    token_histories: Sequence[Sequence[int]]) -> Tensor:
    """llama.cpp's penalties: for each token id seen c > 0 times in the window, a logit <= 0 is
    multiplied by repeat_penalty and a positive one divided by it, then
    c * frequency_penalty + presence_penalty is subtracted. Returns a new tensor when any row
    is penalised, else `logits` itself."""
    vocab, device = logits.shape[1], logits.device
    rows, windows = [], []
    for i, p in enumerate(params):
        if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0
                                    and p.presence_penalty == 0.0):
            continue
        history = token_histories[i]
        start = 0 if p.repeat_last_n < 0 else max(0, len(history) - p.repeat_last_n)
        window = history[start:]
        if len(window):
            if min(window) < 0 or max(window) >= vocab:
                raise ValueError(f"token history of row {i} holds ids outside [0, {vocab})")
            rows.append(i)
            windows.append(list(window))
    if not rows:
        return logits

    # Pad ragged windows with the id `vocab`, counted into an extra column that is dropped.
    width = max(len(w) for w in windows)
    ids = torch.full((len(rows), width), vocab, dtype=torch.int64)
    for j, w in enumerate(windows):
        ids[j, :len(w)] = torch.tensor(w, dtype=torch.int64)
    ids = ids.to(device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    seen = counts > 0

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    chosen = [params[i] for i in rows]
    repeat = column([p.repeat_penalty for p in chosen])
    freq = column([p.frequency_penalty for p in chosen])
    presence = column([p.presence_penalty for p in chosen])
    index = _index(rows, device)
    sub = logits[index]
    scaled = torch.where(sub <= 0, sub * repeat, sub / repeat)
    penalised = torch.where(seen, scaled - (counts * freq + seen.float() * presence), sub)
    result = logits.clone()
    result[index] = penalised
    return result


def filter_logits(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Apply top_k, typical_p, top_p and min_p (in that order, each renormalising over what the
    previous ones kept, at temperature 1) by setting removed logits to -inf. At least one token
    always survives (llama.cpp's min_keep = 1). Returns a new tensor."""
    rows, vocab = logits.shape
    device = logits.device
    if all(_no_filter(p, vocab) for p in params):
        return logits.clone()  # temperature-only rows: skip the full-width sort
    # Work in descending order once; `keep` is a mask in that order.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)

    def column(values: list[float], dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        keep &= rank < column(top_k, torch.int64)

    typical = [p.typical_p for p in params]
    if min(typical) < 1.0:
        probs = _masked_softmax(sorted_logits, keep)
        logp = torch.log(probs)
        live = probs > 0  # a kept token may underflow to 0; 0 * log 0 must count as 0
        entropy = -torch.where(live, probs * logp, torch.zeros_like(probs)).sum(-1, keepdim=True)
        # Rank by how far each token's surprise is from the entropy; keep the closest ones
        # until their mass exceeds p (inclusive of the token that crosses it). Removed tokens
        # sort last (distance inf); position 0 is always a kept token, so min_keep holds.
        distance = torch.where(live, (-logp - entropy).abs(), torch.full_like(probs, math.inf))
        by_distance = distance.argsort(dim=-1, stable=True)
        mass = probs.gather(-1, by_distance)
        p_col = column(typical)
        before = mass.cumsum(-1) - mass
        typical_keep = (before <= p_col) | (rank == 0) | (p_col >= 1.0)
        keep &= torch.zeros_like(keep).scatter(-1, by_distance, typical_keep)

    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        probs = _masked_softmax(sorted_logits, keep)
        before = probs.cumsum(-1) - probs
        # Keep up to and including the token whose cumulative mass reaches p; p >= 1 keeps all
        # (rounding could otherwise drop a tail token whose `before` sums to 1.0).
        p_col = column(top_p)
        keep &= (before < p_col) | _first_kept(keep) | (p_col >= 1.0)

    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p), the max taken over
        # the survivors (typical_p may have removed the overall most probable token).
        first = _first_kept(keep)
        best = torch.where(first, sorted_logits, torch.zeros_like(sorted_logits)).sum(-1, True)
        threshold = best + torch.log(column(min_p))
        keep &= (sorted_logits >= threshold) | first

    masked = torch.where(keep, sorted_logits, torch.full_like(sorted_logits, -math.inf))
    return torch.empty_like(logits).scatter_(-1, order, masked)


def probabilities(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The distribution a row draws from: filters, then temperature, then softmax. A row with
    temperature 0 gets all its mass on its argmax (Sampler.sample never draws for those)."""
    filtered = filter_logits(logits, params)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    temperature = torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(1)
    # Shift by the max before dividing: softmax is shift-invariant, and a tiny temperature then
    # sends the other logits to -inf instead of overflowing the max to inf (inf - inf = nan).
    top = filtered.max(dim=-1, keepdim=True).values
    probs = torch.softmax((filtered - top) / temperature, dim=-1)
    cold = [i for i, p in enumerate(params) if p.temperature == 0]
    if cold:
        rows = _index(cold, logits.device)
        one_hot = torch.zeros_like(probs[rows])
        probs[rows] = one_hot.scatter_(-1, filtered[rows].argmax(-1, keepdim=True), 1.0)
    return probs


def _no_filter(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k <= 0 or p.top_k >= vocab) and p.typical_p >= 1.0 and p.top_p >= 1.0 \
        and p.min_p <= 0.0


def _first_kept(keep: Tensor) -> Tensor:
    """The most probable surviving token of each row (keep is in descending-logit order):
    llama.cpp's min_keep = 1."""
    return keep & (keep.cumsum(-1) == 1)


def _masked_softmax(logits: Tensor, keep: Tensor) -> Tensor:
    return torch.softmax(torch.where(keep, logits, torch.full_like(logits, -math.inf)), dim=-1)


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    # A generator lives on one device; move the row to it rather than fail (slower, correct).
    device = probs.device
    if generator is not None and generator.device != device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(0).to(device)


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)
