"""Per-token log probabilities, as a request that asked for them (SamplingParams.logprobs)
gets them: the sampled token's and the `n` most probable alternatives'. Torch-free: the
coordinator and common/wire.py use it; the engine computes it (LLMEngine._logprobs).

Values are log_softmax of the model's raw logits for that position, before the grammar mask,
penalties, top-k/p filters and temperature: vLLM's default (logprobs_mode "raw_logprobs").
So a greedy token's logprob is the model's own, whatever the request's sampling options."""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int  # the sampled token
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most probable first
