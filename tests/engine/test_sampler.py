import dataclasses
import math

import pytest
import torch

from engine.sampler import (
    NO_TOKEN, Sampler, apply_logit_bias, apply_penalties, forbid_tokens, greedy_tokens, make_generator,
    probabilities,
)
from common.sampling_params import SamplingParams
from tests.helpers.sampling_faults import unchecked

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)  # every filter off


def sample(logits, params, histories=None, generators=None):
    batch = logits.shape[0]
    return Sampler().sample(logits, params, histories or [[] for _ in range(batch)],
                            generators or [None] * batch)


def softmax_list(values, temperature=1.0):
    top = max(values)
    exps = [math.exp((v - top) / temperature) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def allowed_ids(logits: list[float], p: SamplingParams) -> set[int]:
    """An independent, loop-by-loop transcription of llama.cpp's filters (min_keep = 1)."""
    cand = sorted(range(len(logits)), key=lambda i: -logits[i])
    if 0 < p.top_k < len(cand):
        cand = cand[:p.top_k]
    if p.typical_p < 1.0:
        probs = softmax_list([logits[i] for i in cand])
        entropy = -sum(q * math.log(q) for q in probs if q > 0)
        order = sorted(range(len(cand)), key=lambda j: abs(-math.log(probs[j]) - entropy))
        total, kept = 0.0, []
        for j in order:
            kept.append(cand[j])
            total += probs[j]
            if total > p.typical_p:
                break
        cand = sorted(kept, key=lambda i: -logits[i])
    if p.top_p < 1.0:
        probs = softmax_list([logits[i] for i in cand])
        total, kept = 0.0, []
        for i, q in zip(cand, probs):
            kept.append(i)
            total += q
            if total >= p.top_p:
                break
        cand = kept
    if p.min_p > 0.0:
        probs = softmax_list([logits[i] for i in cand])
        cand = [i for i, q in zip(cand, probs) if q >= p.min_p * probs[0]] or cand[:1]
    return set(cand)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(top_k=1, temperature=5.0)] * 3
    gens = [make_generator(i) for i in range(6)]
    out = sample(logits, params, generators=gens)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))


def test_does_not_modify_logits():
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = [SamplingParams(repeat_penalty=1.5, presence_penalty=1.0, seed=1), SamplingParams()]
    sample(logits, params, [[1, 2, 3], [4]], [make_generator(1), None])
    assert torch.equal(logits, before)


def test_seeded_draws_are_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    vocab, steps = 200, 30
    target = SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.01,
                            repeat_penalty=1.2, presence_penalty=0.1, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(top_k=5, temperature=2.0),
              SamplingParams(typical_p=0.5, frequency_penalty=0.3)]
    table = torch.randn(steps, 4, vocab) * 0.5  # flat-ish, so draws vary

    def run(position: int, batch: int) -> list[int]:
        gen = make_generator(target.seed)
        history, drawn = [1, 2, 3], []
        for step in range(steps):
            rows = [r for r in range(batch) if r != position]
            logits = torch.empty(batch, vocab)
            logits[position] = table[step, 0]
            for j, r in enumerate(rows):
                logits[r] = table[step, j + 1]
            params = [others[(r + step) % 3] for r in range(batch)]
            params[position] = target
            histories = [[7, 8, 9 + step] for _ in range(batch)]
            histories[position] = history
            gens = [make_generator(1000 * step + r) for r in range(batch)]
            gens[position] = gen
            token = int(sample(logits, params, histories, gens)[position])
            drawn.append(token)
            history = history + [token]
        return drawn

    alone = run(0, 1)
    assert run(0, 1) == alone
    assert run(2, 4) == alone
    assert run(0, 3) == alone
    assert len(set(alone)) > 5  # really sampling, not a constant
    other_seed = dataclasses.replace(target, seed=99)
    gen = make_generator(other_seed.seed)
    drawn = [int(sample(table[s, :1], [other_seed], [[1, 2, 3]], [gen])[0]) for s in range(steps)]
    assert drawn != alone


def test_make_generator():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    c, d = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(5, generator=c), torch.rand(5, generator=d))
    make_generator(2**70)  # any int seed is accepted


CRAFTED = [
    SamplingParams(temperature=1.5, top_k=5, **{k: v for k, v in OFF.items() if k != "top_k"}),
    SamplingParams(temperature=1.5, top_k=0, top_p=0.6, min_p=0.0, typical_p=1.0),
    SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.2, typical_p=1.0),
    SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.5),
    SamplingParams(temperature=1.5, top_k=12, top_p=0.8, min_p=0.05, typical_p=1.0),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.1, typical_p=0.7),
    SamplingParams(temperature=1.5, top_k=0, top_p=0.0, min_p=0.0, typical_p=1.0),
    # typical_p drops the most probable token here; top_p and min_p must then measure from the
    # best survivor, not from the overall maximum.
    SamplingParams(temperature=1.5, top_k=0, top_p=0.4, min_p=0.5, typical_p=0.5),
    SamplingParams(temperature=1.5, top_k=0, top_p=0.0, min_p=0.0, typical_p=0.5),
]


@pytest.mark.parametrize("params", CRAFTED)
def test_filters_never_pick_outside_their_set(params):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 40, generator=gen) * 2
    allowed = allowed_ids(logits[0].tolist(), params)
    assert 0 < len(allowed) < 40
    batch = 256
    draws = sample(logits.expand(batch, 40).contiguous(), [params] * batch,
                   generators=[make_generator(i) for i in range(batch)])
    for _ in range(3):
        draws = torch.cat([draws, sample(logits.expand(batch, 40).contiguous(), [params] * batch)])
    drawn = set(draws.tolist())
    assert drawn <= allowed
    # Not over-filtering either: every allowed token with a fair share shows up.
    probs = probabilities(logits, [params])[0]
    likely = {i for i in allowed if probs[i] > 0.01}
    assert likely <= drawn
    assert {i for i in range(40) if probs[i] > 0} == allowed
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)


def test_probabilities_are_the_renormalised_softmax():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0, typical_p=1.0)
    expected = softmax_list([3.0, 1.0, 2.0], temperature=0.5)
    got = probabilities(logits, [p])[0].tolist()
    assert got[3] == 0.0 and got[4] == 0.0
    for g, e in zip([got[0], got[1], got[2]], expected):
        assert math.isclose(g, e, rel_tol=1e-6)


def test_top_p_keeps_the_token_that_crosses_p():
    # probs 0.5, 0.3, 0.2: p 0.6 needs the first two; p 0.5 is reached by the first alone.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    for top_p, keep in [(0.6, 2), (0.5, 1), (0.81, 3), (0.0, 1)]:
        p = SamplingParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
        probs = probabilities(logits, [p])[0]
        assert int((probs > 0).sum()) == keep, top_p


def test_temperature_to_zero_approaches_argmax():
    torch.manual_seed(1)
    # Distinct logits 0.01 apart: at T = 1e-4 the runner-up has odds e^-100.
    logits = torch.stack([torch.randperm(1000).float() * 0.01 for _ in range(64)])
    cold = SamplingParams(temperature=1e-4, **OFF)
    draws = sample(logits, [cold] * 64, generators=[make_generator(i) for i in range(64)])
    assert torch.equal(draws, logits.argmax(-1))
    # Far below fp32's range for logits / T (and below what the APIs accept): still a clean
    # one-hot, no nan.
    probs = probabilities(logits[:2], [unchecked(temperature=1e-30, **OFF)] * 2)
    assert torch.equal(probs.argmax(-1), logits[:2].argmax(-1))
    assert torch.all(probs.max(-1).values == 1.0) and not torch.isnan(probs).any()
    # And a hot temperature spreads the mass: the argmax's share shrinks.
    warm = probabilities(logits[:1], [SamplingParams(temperature=1.0, **OFF)])
    hot = probabilities(logits[:1], [SamplingParams(temperature=4.0, **OFF)])
    top = int(logits[0].argmax())
    assert hot[0, top] < warm[0, top] < 1.0


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    history = [[0, 1, 1, 3, 3, 3, 5]]
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [p], history)[0].tolist()
    # seen once: 2/2 - (1*0.25 + 0.5); twice: -1*2 - (0.5 + 0.5); thrice: 3/2 - (0.75 + 0.5);
    # a zero logit counts as non-positive (multiplied): 0*2 - (0.25 + 0.5).
    assert out == [0.25, -3.0, 0.5, 0.25, -2.0, -0.75]


def test_penalty_window():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    history = [[0, 1, 1, 3, 3, 3]]
    last_two = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                              repeat_last_n=2)
    assert apply_penalties(logits, [last_two], history)[0].tolist() == [
        2.0, -1.0, 0.5, 0.5, -2.0, 0.0]
    whole = SamplingParams(repeat_penalty=2.0, repeat_last_n=-1)
    assert apply_penalties(logits, [whole], history)[0].tolist() == [
        1.0, -2.0, 0.5, 1.5, -2.0, 0.0]
    off = SamplingParams(repeat_penalty=2.0, presence_penalty=1.0, repeat_last_n=0)
    assert torch.equal(apply_penalties(logits, [off], history), logits)


def test_penalties_per_row_in_a_batch():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    params = [SamplingParams(presence_penalty=1.0), SamplingParams(),
              SamplingParams(frequency_penalty=0.5)]
    out = apply_penalties(logits, params, [[0], [0, 1, 2], [2, 2]])
    assert out.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert int(sample(logits, [greedy], [[0]])[0]) == 0
    penalised = SamplingParams(temperature=0, repeat_penalty=1.5)
    assert int(sample(logits, [penalised], [[0]])[0]) == 1


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        sample(torch.zeros(1, 4, dtype=torch.bfloat16), [SamplingParams()])
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()], [[]], [None])
    with pytest.raises(ValueError, match="outside"):
        sample(torch.zeros(1, 4), [SamplingParams(repeat_penalty=1.1)], [[4]])
    assert sample(torch.zeros(0, 4), []).shape == (0,)


@pytest.mark.parametrize("bad", [
    unchecked(temperature=1e308),  # inf in fp32: -inf / inf = nan for filtered-out tokens
    unchecked(temperature=1e-300),  # 0 in fp32: 0 / 0 = nan for the top token
    unchecked(temperature=0.5, repeat_penalty=1e-300),
    unchecked(temperature=0.5, frequency_penalty=-1e308),
])
def test_a_row_without_a_distribution_is_reported_and_the_rest_sampled(bad):
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    good = SamplingParams(temperature=0.7, seed=3)
    params = [good, bad, SamplingParams(temperature=0)]
    histories = [[1, 2, 3]] * 3
    generators = [make_generator(3), make_generator(4), None]
    tokens = Sampler().sample(logits, params, histories, generators)
    alone = Sampler().sample(logits[:1], [good], histories[:1], [make_generator(3)])
    assert tokens[1] == NO_TOKEN
    assert tokens[0] == alone[0] and 0 <= tokens[0] < 50
    assert tokens[2] == logits[2].argmax()


def test_nan_logits_are_reported_for_sampled_and_greedy_rows():
    logits = torch.randn(4, 20)
    logits[0, 3] = math.nan
    logits[2, :] = -math.inf  # nothing left to pick
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.8)]
    logits[3, 5] = math.nan
    tokens = sample(logits, params)
    assert tokens.tolist()[0] == NO_TOKEN and tokens.tolist()[2:] == [NO_TOKEN, NO_TOKEN]
    assert tokens[1] == logits[1].argmax()


def test_logit_bias_forces_and_forbids_tokens_under_greedy():
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    best = logits.argmax(-1)
    params = [SamplingParams(temperature=0, logit_bias={"7": 100}),
              SamplingParams(temperature=0, logit_bias={int(best[1]): -100}),
              SamplingParams(temperature=0)]
    out = sample(logits, params)
    assert out[0] == 7 and out[1] != best[1] and out[2] == best[2]
    biased = apply_logit_bias(logits, params)
    assert biased[0, 7] == pytest.approx(float(logits[0, 7]) + 100)
    assert torch.equal(biased[2], logits[2])  # rows without a bias are untouched
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits  # nothing to add: no copy


def test_logit_bias_applies_to_sampled_rows_and_checks_the_vocabulary():
    logits = torch.zeros(1, 20)
    p = SamplingParams(temperature=1.0, logit_bias={"4": 100}, **OFF)
    assert all(int(sample(logits, [p], generators=[make_generator(s)])) == 4 for s in range(20))
    with pytest.raises(ValueError, match="logit_bias names token 20"):
        sample(logits, [SamplingParams(logit_bias={20: 1})])


def test_forbid_tokens_masks_only_the_named_rows_and_ids():
    logits = torch.randn(2, 10)
    out = forbid_tokens(logits, [{1, 3, 99}, ()])  # 99 is past the vocabulary: skipped
    assert out[0, 1] == -math.inf and out[0, 3] == -math.inf
    assert torch.equal(out[1], logits[1]) and out[0, 0] == logits[0, 0]
    assert forbid_tokens(logits, [(), ()]) is logits


def test_greedy_tokens_are_torchs_argmax_first_of_ties_and_skip_bad_rows():
    """greedy_tokens (numpy's argmax on the CPU) picks what torch.argmax picks, the first of
    equal maxima included, on whole batches, on strided views, and reports a row with a NaN
    or with every logit -inf, as the mixed-batch path does."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen).round(decimals=1)  # many ties
    logits[1, 10] = logits[1, 200] = logits[1].max() + 1  # a tie for the top, first at 10
    logits[4, 17] = math.nan
    logits[5] = -math.inf
    want = torch.where(torch.tensor([True, True, True, True, False, False]), logits.argmax(-1), NO_TOKEN)
    assert greedy_tokens(logits).tolist() == want.tolist()
    assert greedy_tokens(logits).tolist()[1] == 10
    view = logits[:4, ::3]
    assert greedy_tokens(view).tolist() == view.argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=0.7)] * 3
    tokens = sample(logits, mixed)
    assert tokens[0] == want[0] and tokens[2] == want[2] and tokens[4] == NO_TOKEN
