"""What one engine step hands back per request (LLMEngine.step)."""

from __future__ import annotations

from dataclasses import dataclass

from common.logprobs import TokenLogprob
from engine.request import RequestStatus


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    status: RequestStatus
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    error: str = ""  # why the request ended FINISHED_ERROR (a step's only failures are per request)
    # Parallel to new_token_ids when the request asked for logprobs (SamplingParams.logprobs),
    # else None.
    logprobs: list[TokenLogprob] | None = None
    # With the request's first token, when it asked for prompt logprobs: entry i is prompt
    # token i + 1's (the first prompt token has none). Else None.
    prompt_logprobs: list[TokenLogprob] | None = None
    # An embedding request's pooled vector, with its finish (engine/embedding.py); else None.
    embedding: list[float] | None = None
