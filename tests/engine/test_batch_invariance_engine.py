"""Batch-invariant mode end to end (kernels/batch_invariance.py): one request's greedy tokens
and logprobs, bit for bit, whether its prompt runs alone, after a prefix-cache hit, cut into
chunks by a small token budget, or packed beside other prompts into passes of more rows than
the kernels' dense switch points, in every weight format; and the default model in a
colocated engine as `tandem run` builds it (int4 decode, fp32 prefill: one copy in the mode).
The disaggregated cluster's check is tests/deploy/test_batch_invariant_cluster.py."""

from __future__ import annotations

import pytest
import torch
import transformers

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from common.hf_config import hf_model_config
from engine.models import model_class
from kernels import batch_invariance

VOCAB = 512
PROMPT_LEN = 70
NEW_TOKENS = 10
PARAMS = SamplingParams(temperature=0.0, num_predict=NEW_TOKENS, logprobs=2)


@pytest.fixture(scope="module")
def weights():
    """A random Llama wide enough for the BLAS libraries' row-count-dependent paths (the tiny
    test models' 64-wide layers mostly stay on one path)."""
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=640,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, rms_norm_eps=1e-5, head_dim=64)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return hf_model_config(cfg.to_dict()), dict(hf.state_dict())


@pytest.fixture
def invariant():
    previous = batch_invariance.set_enabled(True)
    yield
    batch_invariance.set_enabled(previous)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def engine(config, model, budget: int) -> LLMEngine:
    cfg = EngineConfig(model=config, cache=CacheConfig(block_size=16, num_blocks=96),
                       scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16))
    return LLMEngine(model, cfg)


def run(eng: LLMEngine, target: list[int], others: list[list[int]] = (), params=PARAMS):
    """The target's tokens, (logprob, top) per token, and its cached prompt tokens, run beside
    `others` (submitted first, so the target's prompt shares their passes)."""
    reqs = [eng.add_request(p, params, stop_token_ids=frozenset()) for p in others]
    mine = eng.add_request(target, params, stop_token_ids=frozenset())
    tokens, scores, cached = [], [], 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == mine.request_id:
                tokens += out.new_token_ids
                scores += [(lp.logprob, lp.top) for lp in out.logprobs or []]
                cached = max(cached, out.num_cached_tokens)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs + [mine])
    assert eng.block_manager.num_free_blocks == eng.config.cache.num_blocks
    return tokens, scores, cached


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "w8a8"])
def test_a_request_answers_the_same_in_every_batch(weights, invariant, fmt):
    config, state = weights
    model = model_class(config.architecture)(config, state, fmt)
    target, = prompts(11, [PROMPT_LEN])
    others = prompts(12, [90, 45, 120, 33])

    eng = engine(config, model, budget=256)
    alone = run(eng, target)
    assert alone[2] == 0 and len(alone[0]) == NEW_TOKENS
    hit = run(eng, target)  # the prompt's whole blocks come from the prefix cache
    assert hit[2] == PROMPT_LEN // 16 * 16
    chunked = run(engine(config, model, budget=24), target, others)
    packed = run(engine(config, model, budget=256), target, others)  # passes of 256 rows
    for name, got in (("prefix-cache hit", hit), ("chunks of 24", chunked), ("packed", packed)):
        assert got[0] == alone[0], (fmt, name)
        assert got[1] == alone[1], (fmt, name)  # logprobs bit for bit


@pytest.mark.model
def test_the_default_model_answers_a_repeated_chat_the_same(default_gguf, invariant):
    from engine.generation import chat_prompt_ids

    config = EngineConfig(weight_format="int4", prefill_weight_format="fp32",
                          cache=CacheConfig(block_size=16, num_blocks=128),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8))
    eng = LLMEngine.from_path(default_gguf, config)

    def chat(text):
        return chat_prompt_ids(eng, [{"role": "user", "content": text}])

    target = chat("Tell me about the city of Paris, its history, its people and its culture.")
    others = [chat(t) for t in ("Name three rivers.", "What is 12 times 7? Explain it step by step.",
                                "Write a haiku about the sea and the wind over the old harbour.")]
    params = SamplingParams(temperature=0.0, num_predict=24, logprobs=1)
    alone = run(eng, target, params=params)
    hit = run(eng, target, params=params)
    assert hit[2] == len(target) // 16 * 16 > 0
    beside = run(eng, target, others, params=params)  # chunks of 32 beside three other chats
    assert hit[:2] == alone[:2]
    assert beside[:2] == alone[:2]
