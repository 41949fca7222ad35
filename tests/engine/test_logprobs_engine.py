"""Logprobs end to end on a tiny random model: the single-process engine's entries against
log_softmax of its own logits, the validation of the option, and a real cluster (coordinator,
prefill and decode processes, every request prefilled remotely) whose entries, through the real
`ollama` client, equal log_softmax of the single-process engine's logits for the greedy tokens:
the first token's from the prefill worker's PrefillResult, the rest from the decode stream."""

from __future__ import annotations

import ollama
import openai
import pytest
import torch

from common.errors import InvalidOptionError
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk
from common.sampling_params import SamplingParams
from tests.helpers.api_cluster import MODEL, WORKER_ARGS
from tests.helpers.cluster import running_cluster
from reliability.model_factory import make_tiny_hf_model

NUM_PREDICT = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("lp") / "model", "llama")


def reference(model_dir, prompt_ids: list[int], n: int):
    """(greedy tokens, their entries, log_softmax of the logits each was drawn from)."""
    engine = LLMEngine.from_path(model_dir, EngineConfig(cache=CacheConfig(num_blocks=64)))
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def capture(*args, **kwargs):
        logits = execute(*args, **kwargs)
        seen.append(torch.log_softmax(logits[0].float(), -1))
        return logits

    engine.runner.execute = capture
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0, logprobs=n,
                                                            num_predict=NUM_PREDICT))
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request.request_id:
                tokens += out.new_token_ids
                entries += out.logprobs or []
    return tokens, entries, seen


def test_engine_entries_are_log_softmax_of_its_logits(model_dir):
    tokens, entries, seen = reference(model_dir, [1, 5, 9, 33, 4], n=3)
    assert tokens and [e.token_id for e in entries] == tokens
    for e, logp in zip(entries, seen):
        assert e.logprob == pytest.approx(logp[e.token_id].item(), abs=1e-6)
        values, ids = logp.topk(3)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most probable


def test_engine_reports_nothing_unless_asked(model_dir):
    engine = LLMEngine.from_path(model_dir, EngineConfig(cache=CacheConfig(num_blocks=64)))
    asked = engine.add_request([1, 5, 9], SamplingParams(temperature=0, logprobs=0, num_predict=3))
    plain = engine.add_request([1, 5, 7], SamplingParams(temperature=0, num_predict=3))
    got: dict[str, list] = {asked.request_id: [], plain.request_id: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out.logprobs)
    assert all(lp is None for lp in got[plain.request_id])
    assert all(lp is None or (len(lp) == 1 and lp[0].top == ()) for lp in got[asked.request_id])
    assert any(lp for lp in got[asked.request_id])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_the_option_is_validated(value):
    with pytest.raises(InvalidOptionError, match="logprobs"):
        SamplingParams(logprobs=value)
    assert SamplingParams.from_options({"logprobs": 3}).logprobs is None  # no Ollama option


PROMPT = [1, 5, 9, 33, 4, 17, 2, 8, 40, 41, 3, 12, 19, 23, 7, 6, 30, 31, 11, 10, 27, 28, 9]


def full_prompt_logp(engine: LLMEngine, prompt_ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward pass over the whole prompt, every position's logits (no
    prompt_logits rows, no scheduler): [len(prompt_ids), vocab]."""
    runner = engine.runner
    bs = runner.block_size
    table = list(range((len(prompt_ids) + bs - 1) // bs))  # a fresh engine: any blocks will do
    batch = runner.prepare([SequenceChunk(prompt_ids, 0, table, True)])
    with torch.inference_mode():
        hidden = runner.model.forward(batch, runner.kv_cache)
        return torch.log_softmax(runner.model.compute_logits(hidden, batch).float(), -1)


def run_prompt_logprobs(engine: LLMEngine, prompt_ids: list[int], n: int = 2, **kw):
    request = engine.add_request(prompt_ids, SamplingParams(temperature=0, num_predict=2,
                                                            prompt_logprobs=n, **kw))
    firsts = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request.request_id and out.new_token_ids:
                firsts.append(out.prompt_logprobs)
    return request, firsts


def check_prompt_entries(entries, prompt_ids, logp, n):
    assert [e.token_id for e in entries] == prompt_ids[1:]
    for i, e in enumerate(entries):  # entry i scores prompt token i + 1, from position i
        assert e.logprob == pytest.approx(logp[i, prompt_ids[i + 1]].item(), abs=1e-4)
        values, ids = logp[i].topk(n)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [512, 5])  # 5: the prompt spans five chunked passes
def test_prompt_logprobs_equal_one_full_forward(model_dir, budget):
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))
    logp = full_prompt_logp(LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64))), PROMPT)
    request, firsts = run_prompt_logprobs(engine, PROMPT, n=3)
    # Once, with the first token, and never again.
    assert firsts[0] is not None and all(f is None for f in firsts[1:]) and len(firsts) == 2
    check_prompt_entries(firsts[0], PROMPT, logp, 3)


def test_prompt_logprobs_bypass_a_warm_prefix_cache(model_dir):
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64)))
    logp = full_prompt_logp(LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64))), PROMPT)
    warm = engine.add_request(PROMPT, SamplingParams(temperature=0, num_predict=1))
    while engine.has_unfinished():
        engine.step()
    again = engine.add_request(PROMPT, SamplingParams(temperature=0, num_predict=1))
    while engine.has_unfinished():
        engine.step()
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the cache is warm
    request, firsts = run_prompt_logprobs(engine, PROMPT, n=0)
    assert request.num_cached_tokens == 0  # recomputed, not served from the cache
    check_prompt_entries(firsts[0], PROMPT, logp, 0)


def test_prompt_logprobs_cost_nothing_for_others(model_dir):
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=6)))
    plain = engine.add_request(PROMPT[:9], SamplingParams(temperature=0, num_predict=2))
    asked = engine.add_request(PROMPT, SamplingParams(temperature=0, num_predict=2,
                                                      prompt_logprobs=1))
    got: dict[str, list] = {plain.request_id: [], asked.request_id: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out.prompt_logprobs)
    assert all(p is None for p in got[plain.request_id])
    assert len(asked.prompt_logprobs) == len(PROMPT) - 1
    with pytest.raises(InvalidOptionError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_cluster_logprobs_match_the_single_process_engine(model_dir, tmp_path):
    with running_cluster(model_dir, tmp_path / "logs", model=MODEL, worker_args=WORKER_ARGS,
                         prefill_threshold=0) as cluster:
        client = ollama.Client(host=cluster.url, timeout=60)
        options = {"temperature": 0, "num_predict": NUM_PREDICT}
        whole = client.generate(model=MODEL, prompt="Name three rivers.", options=options,
                                logprobs=True, top_logprobs=2)
        parts = list(client.generate(model=MODEL, prompt="Name three rivers.", options=options,
                                     logprobs=True, stream=True))
        # The ollama client drops tandem's own figures; raw HTTP shows where the prefill ran.
        raw = cluster.chat([{"role": "user", "content": "Hi"}], options=options, logprobs=True)
        # Prompt logprobs, lm-eval-harness's call: the same prompt as token ids, scored on
        # the prefill worker (PrefillResult.prompt_logprobs).
        scored = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", timeout=60,
                               max_retries=0).completions.create(
            model=MODEL, prompt=whole.context[:whole.prompt_eval_count], echo=True,
            logprobs=1, max_tokens=0)
    assert raw["tandem"]["prefill_worker"] and len(raw["logprobs"]) == raw["eval_count"]
    prompt_ids = whole.context[:whole.prompt_eval_count]
    output_ids = whole.context[whole.prompt_eval_count:]
    tokens, _, seen = reference(model_dir, prompt_ids, n=2)
    assert output_ids == tokens and len(whole.logprobs) == len(tokens)
    streamed = [e for p in parts for e in (p.logprobs or [])]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.logprobs],
                                                          abs=1e-4)
    for entry, token, logp in zip(whole.logprobs, tokens, seen):
        assert entry.logprob == pytest.approx(logp[token].item(), abs=1e-4)
        values, _ = logp.topk(2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    lp = scored.choices[0].logprobs
    logp = full_prompt_logp(LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(num_blocks=64))), prompt_ids)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt_ids)
    assert lp.token_logprobs[1:] == pytest.approx(
        [logp[i, t].item() for i, t in enumerate(prompt_ids[1:])], abs=1e-4)
    assert scored.usage.completion_tokens == 0
