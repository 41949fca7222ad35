"""Text in, text out on one engine: chat template, tokenization, incremental detokenization
and stop strings around LLMEngine's token loop. `tandem run` and the tests use it; servers do
the same work in the coordinator instead."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from common.detokenizer import IncrementalDetokenizer
from common.errors import SamplingError
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from common.sampling_params import SamplingParams
from common.stop_strings import StopStringMatcher


@dataclass
class GenerationStats:
    """Per-request figures, as Ollama reports them (here in seconds)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prompt_eval_s: float = 0.0  # request start to first token
    eval_s: float = 0.0  # first token to last
    total_s: float = 0.0
    done_reason: str | None = None


class TextStream:
    """Iterates over printable text pieces; `stats` is complete once iteration ends."""

    def __init__(self, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.token_ids: list[int] = []

    def __iter__(self) -> Iterator[str]:
        engine, stats = self.engine, self.stats
        start = time.monotonic()
        detok = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=True)
        stops = StopStringMatcher(self.params.stop) if self.params.stop else None
        request = engine.add_request(self.prompt_ids, self.params)
        first = None
        status = request.status
        try:
            while not status.is_finished:
                for out in engine.step():
                    if out.request_id != request.request_id:
                        continue
                    status = out.status
                    if out.error:  # the engine has already ended it and freed its blocks
                        raise SamplingError(out.error)
                    text = ""
                    for token in out.new_token_ids:
                        first = first or time.monotonic()
                        self.token_ids.append(token)
                        text += detok.push(token)
                    if out.finished:
                        text += detok.flush()
                    if stops is not None:
                        text, stopped = stops.feed(text)
                        if stopped:
                            engine.abort_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                            status = RequestStatus.FINISHED_STOPPED
                        elif out.finished:
                            text += stops.flush()
                    if text:
                        yield text
        finally:
            if not status.is_finished:  # the consumer stopped early: free the request's blocks
                engine.abort_request(request.request_id)
            end = time.monotonic()
            stats.cached_tokens = request.num_cached_tokens
            stats.output_tokens = len(self.token_ids)
            stats.prompt_eval_s = (first or end) - start
            stats.eval_s = end - (first or end)
            stats.total_s = end - start
            stats.done_reason = status.done_reason


def chat_prompt_ids(engine: LLMEngine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=True)
