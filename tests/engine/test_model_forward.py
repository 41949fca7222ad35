"""The LLaMA-family forward pass over the paged cache against Hugging Face transformers.

Tiny random models (built in-process by transformers, fp32, eager attention) are the oracle:
our logits must match theirs at every position, whether the prompt arrives in one pass, in
chunks continuing a cached prefix, or mixed into a ragged batch with other sequences.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig
from common.hf_config import hf_model_config
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class

import transformers  # noqa: E402 - the test oracle (test extra), never a product dependency

ATOL = 2e-4


def build_pair(arch: str = "llama", rope_scaling: dict | None = None, seed: int = 0, vocab: int = 160,
               tie: bool = False, head_dim: int = 16):
    """A random HF model and our model sharing its weights."""
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  head_dim=head_dim)
    if rope_scaling:
        kwargs["rope_scaling"] = rope_scaling
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    hf_cfg = cfg_cls(**kwargs)
    hf_cfg._attn_implementation = "eager"
    hf = model_cls(hf_cfg).eval()
    with torch.no_grad():  # norms start at exactly 1, which would hide a q/k norm mix-up
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    config = hf_model_config(hf_cfg.to_dict())
    weights = dict(hf.state_dict())
    ours = model_class(config.architecture)(config, weights, "fp32")
    return hf, ours


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_chunks(runner: ModelRunner, chunks: list[SequenceChunk]) -> list[torch.Tensor]:
    """Logits at every new position of every chunk, in chunk order."""
    batch = runner.prepare(chunks)
    with torch.inference_mode():
        hidden = runner.model.forward(batch, runner.kv_cache)
        logits = runner.model.compute_logits(hidden)
    cu = batch.cu_seqlens_q.tolist()
    return [logits[cu[i]:cu[i + 1]] for i in range(len(chunks))]


def make_runner(model, num_blocks: int = 64, block_size: int = 16) -> ModelRunner:
    return ModelRunner(model, CacheConfig(block_size=block_size, num_blocks=num_blocks))


def shuffled_table(n_blocks: int, num_blocks: int, seed: int) -> list[int]:
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    return ids[:n_blocks]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_one_shot_prefill_matches_transformers(arch):
    hf, ours = build_pair(arch)
    ids = torch.randint(0, 160, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = make_runner(ours)
    (got,) = run_chunks(runner, [SequenceChunk(ids, 0, shuffled_table(3, 64, 0), True)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 2.0},
])
def test_rope_scaling_matches_transformers(rope_scaling):
    hf, ours = build_pair("llama", rope_scaling=rope_scaling)
    ids = list(range(3, 160, 2))[:70]
    (got,) = run_chunks(make_runner(ours), [SequenceChunk(ids, 0, list(range(5)), True)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_qwen3_with_head_dim_apart_from_hidden_matches_transformers():
    """Qwen3 sets head_dim itself (128 with hidden 1024 in Qwen3-0.6B): q_size != hidden."""
    hf, ours = build_pair("qwen3", head_dim=32)
    assert ours.config.qk_norm and ours.config.q_size == 128 != ours.config.hidden_size
    ids = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = hf_logits(hf, ids)
    runner = make_runner(ours)
    table = shuffled_table(3, 64, 2)
    (prompt,) = run_chunks(runner, [SequenceChunk(ids[:40], 0, table, True)])
    decodes = [run_chunks(runner, [SequenceChunk([t], 40 + i, table, True)])[0] for i, t in enumerate(ids[40:])]
    torch.testing.assert_close(torch.cat([prompt, *decodes]), expected, atol=ATOL, rtol=0)


def test_llama32_tied_embeddings_with_llama3_rope_match_transformers():
    """Llama 3.2 1B/3B: tied embeddings, llama3 rope scaling, GQA."""
    hf, ours = build_pair("llama", tie=True, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    assert ours.config.tie_word_embeddings
    ids = list(range(5, 160, 3))[:50]
    (got,) = run_chunks(make_runner(ours), [SequenceChunk(ids, 0, list(range(4)), True)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 16, 23])
def test_chunked_prefill_then_decode_matches_one_shot(chunk):
    hf, ours = build_pair("llama")
    ids = torch.randint(0, 160, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_logits(hf, ids)
    runner = make_runner(ours)
    table = shuffled_table(4, 64, chunk)
    prompt, decodes = ids[:45], ids[45:]
    got = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        (logits,) = run_chunks(runner, [SequenceChunk(piece, start, table, True)])
        got.append(logits)
    for i, tok in enumerate(decodes):
        (logits,) = run_chunks(runner, [SequenceChunk([tok], 45 + i, table, True)])
        got.append(logits)
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_ragged_batch_gives_each_sequence_its_own_logits():
    """Prefill chunks (fresh and continuing a prefix) and decode tokens in one pass."""
    hf, ours = build_pair("qwen2")
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (40, 17, 33, 9, 64)]
    expected = [hf_logits(hf, s) for s in seqs]
    runner = make_runner(ours, num_blocks=64)
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(len(seqs))]
    # Warm the cache: seq 0 has 39 tokens cached (decode next), seq 2 has 20 (chunk next),
    # seq 4 has 63 (decode next).
    warm = {0: 39, 2: 20, 4: 63}
    for i, n in warm.items():
        run_chunks(runner, [SequenceChunk(seqs[i][:n], 0, tables[i], True)])
    chunks = [
        SequenceChunk(seqs[0][39:], 39, tables[0], True),   # decode
        SequenceChunk(seqs[1], 0, tables[1], True),         # fresh prefill
        SequenceChunk(seqs[2][20:], 20, tables[2], True),   # chunk continuing a prefix
        SequenceChunk(seqs[3], 0, tables[3], True),         # fresh prefill
        SequenceChunk(seqs[4][63:], 63, tables[4], True),   # decode at a block boundary
    ]
    got = run_chunks(runner, chunks)
    starts = [39, 0, 20, 0, 63]
    for g, e, s in zip(got, expected, starts):
        torch.testing.assert_close(g, e[s:], atol=ATOL, rtol=0)


def test_bf16_weights_stay_close_to_fp32():
    hf, ours = build_pair("llama")
    config = ours.config
    bf16 = model_class("llama")(config, dict(hf.state_dict()), "bf16")
    ids = list(range(1, 41))
    (a,) = run_chunks(make_runner(ours), [SequenceChunk(ids, 0, list(range(3)), True)])
    (b,) = run_chunks(make_runner(bf16), [SequenceChunk(ids, 0, list(range(3)), True)])
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
