"""The single-process engine end to end on tiny random models: schedule -> execute -> update
with real blocks, against transformers' greedy generate as the oracle."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from common.errors import ContextLengthError, InvalidOptionError, SamplingError
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from common.sampling_params import SamplingParams
from tests.helpers.sampling_faults import PoisonedSampler, unchecked
from tests.engine.test_model_forward import build_pair

GREEDY = SamplingParams(temperature=0.0)
EOS = 0


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", seed=5)


def make_engine(model, *, budget=64, num_blocks=64, block_size=4, prefix=True, max_seqs=16,
                chunk_cap=0) -> LLMEngine:
    cfg = EngineConfig(model=model.config,
                       cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                                 long_prefill_token_threshold=chunk_cap))
    return LLMEngine(model, cfg)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n, pad_token_id=EOS, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp, stop_token_ids=frozenset()) for p, sp in zip(prompts, params)]
    outputs = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 2000
    return [outputs[r.request_id] for r in reqs], reqs


def prompts_of(lengths, seed=0, vocab=160):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_concurrent_greedy_matches_transformers(pair):
    hf, model = pair
    prompts = prompts_of([3, 40, 17, 90, 8, 33, 61, 5])
    engine = make_engine(model, budget=24)  # forces chunking and mixed batches
    outs, reqs = run_all(engine, prompts, SamplingParams(temperature=0.0, num_predict=12))
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(hf, prompt, 12)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_reuses_blocks_and_keeps_output(pair):
    hf, model = pair
    shared = prompts_of([45], seed=1)[0]
    first, second = shared + [7, 8], shared + [9, 10, 11]
    engine = make_engine(model)
    params = SamplingParams(temperature=0.0, num_predict=6)
    run_all(engine, [first], params)
    outs, (req,) = run_all(engine, [second], params)
    assert req.num_cached_tokens == 44  # 11 full blocks of 4 shared tokens
    assert outs[0] == hf_greedy(hf, second, 6)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_under_a_tiny_pool_keeps_outputs(pair):
    hf, model = pair
    prompts = prompts_of([20, 22, 18, 25], seed=2)
    # 4 requests x (~22 + 16 tokens) need ~40 blocks of 4; the pool has 16.
    engine = make_engine(model, num_blocks=16, budget=64)
    outs, _ = run_all(engine, prompts, SamplingParams(temperature=0.0, num_predict=16))
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(hf, prompt, 16)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_reproducible_whatever_the_batch(pair):
    _, model = pair
    prompt = prompts_of([12], seed=3)[0]
    seeded = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1234, num_predict=10)
    alone, _ = run_all(make_engine(model), [prompt], seeded)
    others = prompts_of([30, 5], seed=4)
    crowd, _ = run_all(make_engine(model), others[:1] + [prompt] + others[1:],
                       [SamplingParams(temperature=1.0, num_predict=10), seeded,
                        SamplingParams(temperature=0.7, num_predict=10)])
    assert crowd[1] == alone[0]
    other_seed, _ = run_all(make_engine(model), [prompt],
                            SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=99, num_predict=10))
    assert other_seed[0] != alone[0]


def test_stop_token_finishes_the_request(pair):
    hf, model = pair
    prompt = prompts_of([10], seed=6)[0]
    expected = hf_greedy(hf, prompt, 8)
    stop_at = expected[3]
    engine = make_engine(model)
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, num_predict=8),
                             stop_token_ids=frozenset({stop_at}))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
    assert got == expected[:expected.index(stop_at) + 1]
    assert req.status is RequestStatus.FINISHED_STOPPED



def test_min_tokens_masks_the_stop_tokens_until_reached(pair):
    hf, model = pair
    prompt = prompts_of([10], seed=6)[0]
    free = hf_greedy(hf, prompt, 12)
    stops = frozenset(free[:6])  # greedy would stop at once
    engine = make_engine(model)
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, num_predict=12, min_tokens=6),
                             stop_token_ids=stops)
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
    assert len(got) >= 6 and not stops & set(got[:6])
    if req.status is RequestStatus.FINISHED_STOPPED:  # after the minimum, a stop ends it
        assert got[-1] in stops and not stops & set(got[:-1])


def test_logit_bias_steers_greedy_decoding(pair):
    hf, model = pair
    prompt = prompts_of([10], seed=6)[0]
    free = hf_greedy(hf, prompt, 6)
    forced, _ = run_all(make_engine(model), [prompt],
                        SamplingParams(temperature=0.0, num_predict=6, logit_bias={"42": 100}))
    assert forced[0] == [42] * 6
    banned, _ = run_all(make_engine(model), [prompt], SamplingParams(
        temperature=0.0, num_predict=6, logit_bias={t: -100 for t in free}))
    assert not set(banned[0]) & set(free)
    with pytest.raises(InvalidOptionError, match="token id 999 is outside the vocabulary"):
        make_engine(model).add_request(prompt, SamplingParams(logit_bias={999: 1}))

def test_context_window_limits(pair):
    _, model = pair
    engine = make_engine(model)
    with pytest.raises(ContextLengthError, match="does not fit"):
        engine.add_request([1 + i % 150 for i in range(600)], GREEDY)
    # The pool (64 blocks of 4) caps the context below the model's 512 positions.
    assert engine.context_length == 256
    with pytest.raises(ContextLengthError, match="context window of 256"):
        engine.add_request([1 + i % 150 for i in range(300)], GREEDY)
    with pytest.raises(InvalidOptionError, match="token id 160 is outside the vocabulary"):
        engine.add_request([5, 160], GREEDY)
    with pytest.raises(ContextLengthError, match="context window of 32"):
        engine.add_request(list(range(1, 40)), SamplingParams(temperature=0.0, num_ctx=32))
    # A prompt that leaves room for 4 tokens is cut at the context edge.
    outs, (req,) = run_all(engine, [list(range(1, 29))], SamplingParams(temperature=0.0, num_ctx=32))
    assert len(outs[0]) == 4 and req.status is RequestStatus.FINISHED_LENGTH


def test_abort_mid_prefill_and_mid_decode_frees_blocks(pair):
    _, model = pair
    # The chunk cap leaves part of each pass's budget for the short request.
    engine = make_engine(model, budget=8, chunk_cap=6)
    long = engine.add_request(prompts_of([60])[0], SamplingParams(temperature=0.0, num_predict=50))
    short = engine.add_request([5, 6], SamplingParams(temperature=0.0, num_predict=50))
    for _ in range(3):
        engine.step()
    assert long.num_computed_tokens < 60 and short.num_output_tokens > 0
    engine.abort_request(long.request_id)
    engine.abort_request(short.request_id)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def run_mixed(engine: LLMEngine, prompts, params, traced: bool = False):
    """run_all, keeping every StepOutput. traced: each request gets a log id (`log-I`) and a
    pass record list, as a worker gives them while traces are on."""
    reqs = [engine.add_request(p, sp, stop_token_ids=frozenset()) for p, sp in zip(prompts, params)]
    for i, r in enumerate(reqs if traced else ()):
        r.log_id, r.passes = f"log-{i}", []
    outputs = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        assert steps < 2000
    return [outputs[r.request_id] for r in reqs], reqs


@pytest.mark.parametrize("bad", [dict(temperature=1e308), dict(temperature=1e-300),
                                 dict(temperature=0.5, repeat_penalty=1e-300),
                                 dict(temperature=0.5, frequency_penalty=-1e308)])
def test_a_request_whose_sampling_fails_ends_with_an_error_and_the_batch_goes_on(pair, bad):
    hf, model = pair
    good_prompt, bad_prompt = prompts_of([14, 9], seed=8)
    engine = make_engine(model)
    params = [SamplingParams(temperature=0.0, num_predict=6),
              unchecked(SamplingParams(num_predict=6), **bad)]
    (good, failed), (good_req, bad_req) = run_mixed(engine, [good_prompt, bad_prompt], params)
    assert [t for out in good for t in out.new_token_ids] == hf_greedy(hf, good_prompt, 6)
    assert good_req.status is RequestStatus.FINISHED_LENGTH and not good[-1].error
    (out,) = failed
    assert out.finished and out.new_token_ids == [] and out.status is RequestStatus.FINISHED_ERROR
    assert "sampling failed" in out.error and "temperature" in out.error
    assert bad_req.status is RequestStatus.FINISHED_ERROR
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("raises", [False, True])
def test_sampling_failure_mid_decode_frees_the_request_and_spares_the_rest(pair, raises, caplog):
    hf, model = pair
    prompts = prompts_of([14, 9, 20], seed=9)
    poisoned = SamplingParams(temperature=0.0, num_predict=8)
    engine = make_engine(model)
    engine.sampler = PoisonedSampler(poisoned, len(prompts[1]), after=3, raises=raises)
    params = [SamplingParams(temperature=0.0, num_predict=8), poisoned,
              SamplingParams(temperature=0.0, num_predict=8)]
    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        (first, failed, third), reqs = run_mixed(engine, prompts, params, traced=True)
    if raises:  # the row's own failure is logged with its request's id (engine thread)
        (line,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert reqs[1].request_id in line.getMessage() and line.request_id == "log-1"
    for outs, prompt in ((first, prompts[0]), (third, prompts[2])):
        assert [t for out in outs for t in out.new_token_ids] == hf_greedy(hf, prompt, 8)
    assert [t for out in failed for t in out.new_token_ids] == hf_greedy(hf, prompts[1], 3)
    assert failed[-1].status is RequestStatus.FINISHED_ERROR and failed[-1].finished
    assert "sampling failed" in failed[-1].error
    if raises:
        assert "RuntimeError" in failed[-1].error
    assert reqs[1].status is RequestStatus.FINISHED_ERROR
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # generate() reports it as an error, not as a short answer.
    with pytest.raises(SamplingError, match="sampling failed"):
        list(engine.generate(prompts[1], poisoned))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_traced_request_gets_a_record_of_each_pass_that_computed_it(pair):
    """The worker's trace spans (prefill chunks, decode steps) come from these records."""
    _, model = pair
    prompts = prompts_of([14, 9], seed=10)
    engine = make_engine(model)
    params = [SamplingParams(temperature=0.0, num_predict=5)] * 2
    _, reqs = run_mixed(engine, prompts, params, traced=True)
    for req, prompt in zip(reqs, prompts):
        passes = req.passes
        assert len(passes) == 5  # one prompt pass, then one decode step per further token
        assert not passes[0].decode and passes[0].tokens == len(prompt)
        assert all(p.decode and p.tokens == 1 for p in passes[1:])
        assert all(p.start_ns <= p.end_ns for p in passes)
        assert all(a.end_ns <= b.start_ns for a, b in zip(passes, passes[1:]))
        assert all(1 <= p.batch_size <= 2 and p.batch_tokens >= p.tokens for p in passes)
    # Both prompts fit one pass's budget: they shared it, then every decode step.
    assert reqs[0].passes[0].batch_tokens == sum(map(len, prompts))
    assert [p.start_ns for p in reqs[0].passes] == [p.start_ns for p in reqs[1].passes]
    untraced = engine.add_request(prompts[0], params[0])
    while engine.has_unfinished():
        engine.step()
    assert untraced.passes is None
