"""Speculative decoding (prompt lookup) in the engine on tiny random models: greedy output
identical to plain decoding, stops exact inside an accepted run, every KV block back in the
pool, seeded sampling reproducible, drafts within the token budget."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.draft_length import PROBE_INTERVAL, DraftLength, probe_interval
from engine.speculative import SpeculativeDecoder
from engine.speculative_config import SpeculativeConfig
from tests.engine.test_model_forward import build_pair

GREEDY = SamplingParams(temperature=0.0, num_predict=30)
# Draft counts here follow from acceptance alone (the cost gate's test gives its own times).
pytestmark = pytest.mark.usefixtures("open_cost_gate")
MEASURED_COST_RATIO = SpeculativeDecoder.cost_ratio  # the real property, before any pinning


@pytest.fixture(scope="module")
def model():
    # Random models settle into short cycles (e.g. 144 7 144 7 ...), which prompt lookup
    # copies; seed 4's also leaves them, so drafts are both accepted and rejected.
    return build_pair("llama", seed=4)[1]


def make_engine(model, speculative: SpeculativeConfig | None, *, budget=64, num_blocks=64,
                block_size=4) -> LLMEngine:
    cfg = EngineConfig(model=model.config,
                       cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                       speculative=speculative)
    return LLMEngine(model, cfg)


def prompts_of(lengths, seed=3):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(1, 160, (max(lengths),), generator=gen).tolist()
    # A repeated stretch, so the prompt itself invites copying.
    return [(base[:n // 3] * 3 + base[:n % 3 + 1])[:n] for n in lengths]


def run(engine: LLMEngine, prompts, params, stop_token_ids=frozenset()):
    """Outputs per request, and the sizes of the steps' outputs (a size > 1 is an accepted run)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp, stop_token_ids=stop_token_ids) for p, sp in zip(prompts, params)]
    outputs = {r.request_id: [] for r in reqs}
    sizes = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            sizes[out.request_id].append(len(out.new_token_ids))
        steps += 1
        assert steps < 500
    return [outputs[r.request_id] for r in reqs], [sizes[r.request_id] for r in reqs], reqs


def assert_pool_full(engine: LLMEngine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.owners() == []


SPEC = SpeculativeConfig(num_speculative_tokens=4)


def test_greedy_batch_1_equals_plain_decoding_and_drafts_are_accepted(model):
    (prompt,) = prompts_of([30])
    (plain,), _, _ = run(make_engine(model, None), [prompt], GREEDY)
    engine = make_engine(model, SPEC)
    (spec,), (sizes,), (req,) = run(engine, [prompt], GREEDY)
    assert spec == plain and len(spec) == 30
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0 and max(sizes) > 1
    assert stats.num_draft_tokens >= stats.num_accepted_tokens
    assert stats.num_emitted_tokens == stats.num_steps + stats.num_accepted_tokens
    assert 1.0 < stats.tokens_per_step <= 5.0 and 0.0 < stats.acceptance_rate <= 1.0
    assert sum(sizes) == 30 and len(sizes) < 30  # fewer steps than tokens
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_pool_full(engine)
    assert engine.speculator.proposer.states == {}  # per-request state forgotten at the finish


@pytest.mark.parametrize("budget", [64, 7])
def test_greedy_mixed_batch_of_3_equals_plain_decoding(model, budget):
    # budget 7: the prompts are chunked beside running speculating decodes, and drafts are cut
    # to what the budget leaves.
    prompts = prompts_of([9, 31, 20])
    plain, _, _ = run(make_engine(model, None, budget=budget), prompts, GREEDY)
    engine = make_engine(model, SPEC, budget=budget)
    spec, sizes, _ = run(engine, prompts, GREEDY)
    assert spec == plain
    assert engine.spec_stats.num_accepted_tokens > 0
    assert_pool_full(engine)


def test_a_small_pool_drops_drafts_rather_than_preempting(model):
    prompts = prompts_of([9, 31, 20])
    plain, _, _ = run(make_engine(model, None), prompts, GREEDY)
    engine = make_engine(model, SPEC, num_blocks=20)  # 3 requests of up to 61 tokens: tight
    spec, _, _ = run(engine, prompts, GREEDY)
    assert spec == plain
    assert_pool_full(engine)


def test_rejected_draft_blocks_are_freed_at_once(model):
    (prompt,) = prompts_of([30])
    engine = make_engine(model, SPEC, block_size=2)
    req = engine.add_request(prompt, GREEDY, stop_token_ids=frozenset())
    bm = engine.block_manager
    while not req.status.is_finished:
        engine.step()
        if not req.status.is_finished:
            # Between steps a request holds at most the blocks its tokens need (the last
            # token's slot included): none for drafts.
            assert len(bm.block_table(req.request_id)) <= -(-req.num_tokens // 2)
            assert req.num_computed_tokens == req.num_tokens - 1
    assert engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens > 0
    assert_pool_full(engine)


def test_stops_inside_an_accepted_run_are_exact(model):
    (prompt,) = prompts_of([30])
    (reference,), _, _ = run(make_engine(model, None), [prompt], GREEDY)
    ended_in_a_run = 0
    for n in range(1, 31):  # max_tokens at every position
        params = SamplingParams(temperature=0.0, num_predict=n)
        engine = make_engine(model, SPEC)
        (out,), (sizes,), (req,) = run(engine, [prompt], params)
        assert out == reference[:n] and req.status is RequestStatus.FINISHED_LENGTH
        ended_in_a_run += sizes[-1] > 1
        assert_pool_full(engine)
    for stop in sorted(set(reference)):  # a stop token (EOS) at each token's first place
        engine = make_engine(model, SPEC)
        (out,), (sizes,), (req,) = run(engine, [prompt], GREEDY, stop_token_ids=frozenset({stop}))
        assert out == reference[:reference.index(stop) + 1]
        assert req.status is RequestStatus.FINISHED_STOPPED
        ended_in_a_run += sizes[-1] > 1
        assert_pool_full(engine)
    assert ended_in_a_run > 0  # some stop really fell inside a multi-token run


def test_min_tokens_masks_stop_tokens_row_by_row(model):
    (prompt,) = prompts_of([30])
    (reference,), _, _ = run(make_engine(model, None), [prompt], GREEDY)
    stop = frozenset({reference[2]})
    for min_tokens in (0, 4, 9):
        params = SamplingParams(temperature=0.0, num_predict=30, min_tokens=min_tokens)
        (plain,), _, _ = run(make_engine(model, None), [prompt], params, stop_token_ids=stop)
        engine = make_engine(model, SPEC)
        (spec,), _, _ = run(engine, [prompt], params, stop_token_ids=stop)
        assert spec == plain
        assert_pool_full(engine)


def test_abort_between_steps_and_during_a_pass_frees_every_block(model):
    prompts = prompts_of([30, 21])
    engine = make_engine(model, SPEC)
    a, b = (engine.add_request(p, GREEDY, stop_token_ids=frozenset()) for p in prompts)
    while engine.spec_stats.num_accepted_tokens == 0:
        engine.step()
    engine.abort_request(a.request_id)  # between steps, after it speculated
    # b aborted while its pass (with a draft) runs, as a worker's thread may do.
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
    assert engine.speculator.proposer.states == {}


def test_seeded_sampling_is_reproducible_and_speculates(model):
    prompts = prompts_of([30, 12])
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=42, num_predict=25)

    def once():
        engine = make_engine(model, SPEC)
        outs, _, _ = run(engine, prompts, params)
        assert_pool_full(engine)
        return outs, engine.spec_stats

    first, stats = once()
    second, _ = once()
    assert first == second and all(len(o) == 25 for o in first)
    assert stats.num_steps > 0 and stats.num_draft_tokens > 0


def test_requests_that_do_not_speculate(model):
    (prompt,) = prompts_of([30])
    engine = make_engine(model, SPEC)
    for params in (SamplingParams(temperature=0.0, num_predict=10, logprobs=2),
                   SamplingParams(temperature=0.0, num_predict=10, repeat_penalty=1.3)):
        run(engine, [prompt], params)
    assert engine.spec_stats.num_steps == 0
    assert_pool_full(engine)


def test_drafts_count_against_the_token_budget(model):
    (prompt,) = prompts_of([30])
    engine = make_engine(model, SPEC, budget=3)
    req = engine.add_request(prompt, GREEDY, stop_token_ids=frozenset())
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    while engine.has_unfinished():
        engine.step()
    assert all(p.num_batched_tokens <= 3 for p in plans)
    widest = max(len(c.draft_token_ids) for p in plans for c in p.chunks)
    assert widest == 2  # 1 token + 2 drafts fill a budget of 3
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_pool_full(engine)


def test_a_request_that_opts_out_never_speculates(model):
    (prompt,) = prompts_of([30])
    engine = make_engine(model, SPEC)
    off = SamplingParams(temperature=0.0, num_predict=30, speculative=False)
    (out,), (sizes,), _ = run(engine, [prompt], off)
    assert engine.spec_stats.num_steps == 0 and set(sizes) == {1}
    (spec,), _, _ = run(engine, [prompt], GREEDY)
    assert spec == out and engine.spec_stats.num_steps > 0
    assert_pool_full(engine)


@pytest.mark.parametrize("pick", ["argmin", "argmax"])
def test_verified_tokens_follow_the_requests_own_sampling_distribution(pick):
    # The verification applies the request's logit_bias, top_k and temperature to each row
    # before rejection sampling: the first token of the run must be distributed as the token
    # a plain step would draw from row 0 (chi-square on a fixed seed).
    from engine.request import Request
    from engine.sampler import Sampler, apply_logit_bias, probabilities
    from engine.speculative import SpeculativeDecoder

    vocab, n = 8, 4000
    params = SamplingParams(temperature=0.7, top_k=5, top_p=1.0, logit_bias=((6, 1.5),))
    request = Request("r", [1, 2, 3, 1, 2], params, max_tokens=10)
    request.append_token(3)
    request.num_computed_tokens, request.status = 5, RequestStatus.RUNNING
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(11)) * 2
    decoder = SpeculativeDecoder(SPEC, Sampler())
    gen = torch.Generator().manual_seed(5)
    # argmin: a draft top_k removes, always rejected and resampled; argmax: mostly accepted.
    draft = [int(getattr(logits[0], pick)())]
    firsts = [decoder.verify(request, draft, logits, lambda i: gen)[0] for _ in range(n)]
    expected = probabilities(apply_logit_bias(logits[:1], [params]), [params])[0].double()
    observed = torch.bincount(torch.tensor(firsts), minlength=vocab).double()
    support = expected > 0
    assert set(torch.nonzero(observed).flatten().tolist()) <= set(torch.nonzero(support).flatten().tolist())
    chi2 = float(((observed[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    assert chi2 < 20.5  # 4 degrees of freedom (5 tokens kept by top_k): the 99.96% quantile
    stats = decoder.stats
    assert stats.num_steps == n and stats.num_draft_tokens == n
    assert stats.num_accepted_tokens == sum(f == draft[0] for f in firsts)


def test_the_cost_gate_weighs_expected_tokens_against_the_measured_step_cost(monkeypatch):
    """engine/draft_length.py: a draft of L tokens at acceptance a is expected to emit 1 + aL
    tokens; it is made only when that beats what a drafted step costs over a plain one."""
    monkeypatch.setattr(SpeculativeDecoder, "cost_ratio", MEASURED_COST_RATIO)
    length = DraftLength(acceptance=0.3)  # k = 4: L = 1, expected 1.3 tokens a step
    assert length.draft_length(4, 1.2) == 1
    gated = [length.draft_length(4, 1.3) for _ in range(2 * PROBE_INTERVAL)]
    assert gated.count(1) == 1 and set(gated) == {0, 1}  # probes only, every 10 steps
    assert probe_interval(1.3) == 10 and probe_interval(1.0) == PROBE_INTERVAL
    assert probe_interval(2.08) == 36  # the CPU's 2-token pass: probing 1 step in 36
    decoder = SpeculativeDecoder(SPEC, sampler=None)
    assert decoder.cost_ratio == 1.0  # unknown until both kinds of step ran: try drafting
    decoder.observe_step(0.030, drafted=True, batch_size=1)
    assert decoder.cost_ratio == 1.0
    decoder.observe_step(0.040, drafted=False, batch_size=4)  # per sequence: 10 ms
    assert decoder.cost_ratio == pytest.approx(3.0)


def test_a_closed_gate_stops_greedy_drafts_and_never_changes_a_seeded_answer(model, monkeypatch):
    prompts = prompts_of([30, 12])
    seeded = SamplingParams(temperature=0.7, top_k=20, seed=42, num_predict=25)
    runs = {}
    for ratio in (1.0, 10.0):  # open, and closed: a drafted step said to cost 10 plain ones
        monkeypatch.setattr(SpeculativeDecoder, "cost_ratio", property(lambda self, r=ratio: r))
        greedy_engine, seeded_engine = make_engine(model, SPEC), make_engine(model, SPEC)
        runs[ratio] = (run(greedy_engine, prompts, GREEDY)[0], greedy_engine.spec_stats,
                       run(seeded_engine, prompts, seeded)[0], seeded_engine.spec_stats)
    (greedy_open, open_stats, seeded_open, seeded_stats), (greedy_shut, shut_stats, seeded_shut,
                                                           seeded_shut_stats) = runs[1.0], runs[10.0]
    assert greedy_shut == greedy_open  # greedy: the same answer, far fewer drafts
    assert shut_stats.num_draft_tokens <= open_stats.num_draft_tokens / 2
    assert seeded_shut == seeded_open  # sampled: drafts follow its history, not the gate
    assert seeded_shut_stats.num_draft_tokens == seeded_stats.num_draft_tokens > 0
