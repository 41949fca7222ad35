"""Draft-model speculative decoding (--speculative draft:MODEL,k=N) on tiny random models:
greedy output identical to plain decoding with the target as its own draft (every draft
accepted) and with a different draft (few accepted); sampled output distributed as the
target's with a different draft; the draft's blocks and state freed at every finish and
abort; refusals."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.draft_proposer import check_same_vocabulary
from engine.llm_engine import LLMEngine
from engine.rejection_sampler import rejection_sample
from engine.request import RequestStatus
from engine.speculative_config import SpeculativeConfig, parse_speculative
from tests.engine.test_model_forward import build_pair
from tests.engine.test_speculative import assert_pool_full, prompts_of, run

GREEDY = SamplingParams(temperature=0.0, num_predict=24)
# Draft counts here follow from acceptance alone (tests/engine/conftest.py).
pytestmark = pytest.mark.usefixtures("open_cost_gate")
DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=4, draft_model="tiny")


@pytest.fixture(scope="module")
def target():
    return build_pair("llama", seed=4)[1]


@pytest.fixture(scope="module")
def other_draft():
    return build_pair("llama", seed=9)[1]  # same vocabulary (160), different weights


def make_engine(model, draft=None, *, budget=64, num_blocks=64, block_size=4, k=4) -> LLMEngine:
    spec = None if draft is None else SpeculativeConfig(method="draft", num_speculative_tokens=k,
                                                        draft_model="tiny")
    cfg = EngineConfig(model=model.config, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget), speculative=spec)
    return LLMEngine(model, cfg, draft_model=draft)


def assert_draft_freed(engine: LLMEngine):
    proposer = engine.speculator.proposer
    assert proposer.states == {} and proposer._generators == {}
    proposer.blocks.check_invariants()
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    assert engine.speculator._draft_probs == {} or all(
        rid in engine.scheduler.requests for rid in engine.speculator._draft_probs)


@pytest.mark.parametrize("budget", [64, 7])
def test_self_draft_greedy_equals_plain_and_accepts_every_draft(target, budget):
    prompts = prompts_of([9, 31, 20])
    plain, _, _ = run(make_engine(target, budget=budget), prompts, GREEDY)
    engine = make_engine(target, target, budget=budget)
    spec, sizes, reqs = run(engine, prompts, GREEDY)
    assert spec == plain
    stats = engine.spec_stats
    assert stats.method == "draft" and stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0
    assert stats.tokens_per_step > 1.5 and max(max(s) for s in sizes) > 1
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_pool_full(engine)
    assert_draft_freed(engine)


def test_a_different_draft_keeps_greedy_output(target, other_draft):
    prompts = prompts_of([9, 31, 20])
    plain, _, _ = run(make_engine(target), prompts, GREEDY)
    engine = make_engine(target, other_draft)
    spec, _, _ = run(engine, prompts, GREEDY)
    assert spec == plain
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate < 0.9
    assert_pool_full(engine)
    assert_draft_freed(engine)


def test_a_draft_the_target_rejects_drafts_less_and_less(target, other_draft):
    """Adaptive k (engine/draft_length.py): each draft token costs a pass of the draft model,
    so a draft that disagrees with the target shrinks to occasional one-token probes; the
    output stays the plain one. The self-draft, always accepted, keeps drafting k."""
    prompts = prompts_of([9, 31, 20])
    long = SamplingParams(temperature=0.0, num_predict=64)
    plain, _, _ = run(make_engine(target), prompts, long)
    engine = make_engine(target, other_draft)
    lengths: list[int] = []  # each step's draft length per request
    proposer = engine.speculator.proposer
    propose = proposer.propose_drafts

    def counting(wanted):
        drafts = propose(wanted)
        lengths.extend(len(d.token_ids) for d in drafts.values())
        return drafts

    proposer.propose_drafts = counting
    spec, _, _ = run(engine, prompts, long)
    assert spec == plain
    assert engine.spec_stats.acceptance_rate < 0.5
    head, tail = lengths[:6], lengths[-12:]
    assert max(head) == 4 and sum(tail) / len(tail) < 2  # the drafts shrank
    # Steps with no draft at all (only probes every PROBE_INTERVAL) or short ones: far fewer
    # draft tokens than k a step.
    assert engine.spec_stats.num_draft_tokens < 4 * 3 * 63 / 2
    assert_draft_freed(engine)
    selfish = make_engine(target, target)
    run(selfish, prompts, long)
    assert selfish.spec_stats.num_draft_tokens / selfish.spec_stats.num_steps > 3


def test_stops_inside_a_run_and_small_pools(target):
    (prompt,) = prompts_of([30])
    (reference,), _, _ = run(make_engine(target), [prompt], GREEDY)
    for n in (1, 2, 5, 11):
        engine = make_engine(target, target)
        (out,), _, _ = run(engine, [prompt], SamplingParams(temperature=0.0, num_predict=n))
        assert out == reference[:n]
        assert_pool_full(engine)
        assert_draft_freed(engine)
    stop = reference[7]
    engine = make_engine(target, target, num_blocks=14)  # tight: drafts dropped, not preempting
    (out,), _, _ = run(engine, [prompt], GREEDY, stop_token_ids=frozenset({stop}))
    assert out == reference[:reference.index(stop) + 1]
    assert_pool_full(engine)
    assert_draft_freed(engine)


def test_abort_between_steps_and_during_a_pass_frees_the_drafts_state(target, other_draft):
    prompts = prompts_of([30, 21])
    engine = make_engine(target, other_draft)
    a, b = (engine.add_request(p, SamplingParams(temperature=0.8, seed=3, num_predict=40),
                               stop_token_ids=frozenset()) for p in prompts)
    while engine.spec_stats.num_steps == 0:
        engine.step()
    assert engine.speculator.proposer.states  # the draft holds state for both
    engine.abort_request(a.request_id)
    execute = engine.runner.execute
    aborted = []

    def racing(chunks, *args, **kwargs):
        if not aborted and any(len(c.token_ids) > 1 for c in chunks):
            engine.abort_request(b.request_id)
            aborted.append(True)
        return execute(chunks, *args, **kwargs)

    engine.runner.execute = racing
    while engine.has_unfinished():
        engine.step()
    assert aborted and a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert_pool_full(engine)
    assert_draft_freed(engine)


def test_seeded_sampling_with_a_draft_is_reproducible(target, other_draft):
    prompts = prompts_of([30, 12])
    params = SamplingParams(temperature=0.9, seed=42, num_predict=20)

    def once():
        engine = make_engine(target, other_draft)
        outs, _, _ = run(engine, prompts, params)
        assert_pool_full(engine)
        assert_draft_freed(engine)
        return outs, engine.spec_stats

    first, stats = once()
    second, _ = once()
    assert first == second and all(len(o) == 20 for o in first)
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_rejection_sampling_with_a_draft_distribution_keeps_the_targets():
    # Two-token runs from a draft q that differs from p: the first emitted token must be
    # distributed as p[0], and the second, given an accepted first draft, as p[1]
    # (chi-square on fixed seeds). The draft is drawn from q, as the draft model does.
    vocab, n = 6, 6000
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    firsts, seconds = [], []
    for _ in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = rejection_sample(p, draft, [gen] * 3, q)
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
    for tokens, row, dof_quantile in ((firsts, p[0], 20.5), (seconds, p[1], 20.5)):
        observed = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        expected = row.double() * len(tokens)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < dof_quantile  # 5 degrees of freedom: the 99.9% quantile
    # With q = one-hot rows the draft-probability path is the point-mass one.
    onehot = torch.zeros(1, vocab)
    onehot[0, 2] = 1.0
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert rejection_sample(p[:2], [2], [g1] * 2, onehot) == rejection_sample(p[:2], [2], [g2] * 2)


def test_sampled_output_with_a_different_draft_follows_the_target(target, other_draft):
    # End to end: the first speculated token's distribution, over many seeds, with and without
    # a draft (the first output is plain; the second is the first drafted and verified one).
    (prompt,) = prompts_of([12])
    counts = {}
    for name, draft in (("plain", None), ("draft", other_draft)):
        engine = make_engine(target, draft)
        reqs = [engine.add_request(prompt, SamplingParams(temperature=1.5, seed=s, num_predict=3),
                                   stop_token_ids=frozenset()) for s in range(600)]
        while engine.has_unfinished():
            engine.step()
        counts[name] = torch.bincount(torch.tensor([r.output_token_ids[1] for r in reqs]),
                                      minlength=160).double()
        if draft is not None:
            assert engine.spec_stats.num_draft_tokens > 0
            assert_draft_freed(engine)
    # Two-sample chi-square over the tokens seen at least 5 times in all.
    a, b = counts["plain"], counts["draft"]
    keep = (a + b) >= 10
    chi2 = float(((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5  # about 4 sigma above the mean


def test_refusals(target):
    with pytest.raises(ValueError, match="draft needs its model first"):
        parse_speculative("draft:,k=3")
    with pytest.raises(ValueError, match="k=N is required"):
        parse_speculative("draft:smollm2")
    with pytest.raises(ValueError, match="1..16"):
        parse_speculative("draft:smollm2,k=17")
    with pytest.raises(ValueError, match="unknown option 'n'"):
        parse_speculative("draft:smollm2,k=2,n=2")
    assert parse_speculative("draft:/models/x,k=3").spec == "draft:/models/x,k=3"
    with pytest.raises(ValueError, match="has 170 tokens, the target.s 160"):
        make_engine(target, build_pair("llama", seed=1, vocab=170)[1])
    with pytest.raises(ValueError, match="not loaded"):
        LLMEngine(target, EngineConfig(model=target.config, cache=CacheConfig(num_blocks=8),
                                       speculative=DRAFT))

    class Tok:
        def __init__(self, names):
            self.names = names

        def id_to_token(self, i):
            return self.names[i]

    same = [f"t{i}" for i in range(160)]
    check_same_vocabulary(160, 160, Tok(same), Tok(list(same)))
    with pytest.raises(ValueError, match="token 100"):
        check_same_vocabulary(160, 160, Tok(same), Tok(same[:100] + ["x"] + same[101:]))


def test_from_path_loads_the_draft_by_path_and_refuses_an_unknown_one(tmp_path, monkeypatch):
    from tests.helpers.coordinator_fakes import write_tiny_tokenizer

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))  # no store of the host's
    model_dir = tmp_path / "tiny"
    # A byte-level tokenizer needs 259+ tokens.
    build_pair("llama", seed=4, vocab=320)[0].save_pretrained(model_dir, safe_serialization=True)
    write_tiny_tokenizer(model_dir, 320)
    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32),
                       speculative=parse_speculative(f"draft:{model_dir},k=3"))
    engine = LLMEngine.from_path(model_dir, cfg, load_tokenizer=False)  # tokenizers compared
    prompt = [3, 5, 7, 9, 11, 13]
    out = list(engine.generate(prompt, SamplingParams(temperature=0.0, num_predict=12)))
    plain = LLMEngine.from_path(model_dir, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=32)),
                                load_tokenizer=False)
    assert out == list(plain.generate(prompt, SamplingParams(temperature=0.0, num_predict=12)))
    assert engine.spec_stats.acceptance_rate == 1.0 and engine.spec_stats.num_draft_tokens > 0
    assert_draft_freed(engine)
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="cannot load the draft model"):
        LLMEngine.from_path(model_dir, EngineConfig(speculative=parse_speculative(
            f"draft:{missing},k=3")), load_tokenizer=False)
