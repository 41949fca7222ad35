"""One admitted request at the text level: token ids from the request flow become text pieces
(detokenized, stop strings applied), timed for the metrics and the Ollama figures.

Life cycle, driven by the HTTP layer:

    Coordinator.begin(...)  -> Generation   (admission slot held)
    async for piece in generation.pieces()  (once; WorkerError ends it mid-stream)
    await generation.close()                (always, exactly once in effect: cancels whatever
                                             is still running, frees the slot, records metrics)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from coordinator.logprobs import completion_logprobs, content_entries, prompt_completion_logprobs
from coordinator.metrics import ModelMetrics, RequestTimings
from coordinator.request_flow import FlowOutcome, FlowRequest, RequestFlow, WorkerError
from coordinator.text_stream import TextStream
from common.logprobs import TokenLogprob
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, request: FlowRequest, timings: RequestTimings, flow: RequestFlow,
                 tokenizer: Tokenizer, metrics: ModelMetrics, release: Callable[[], None]) -> None:
        self.request = request
        self.timings = timings
        self.outcome = FlowOutcome()
        self.done_reason: str | None = None  # "stop" | "length" once finished normally
        self.error: str | None = None
        self.output_ids: list[int] = []  # generated token ids (Ollama's `context` needs them)
        # Logprob entries of the tokens so far, when the request asked (common/logprobs.py);
        # those not yet taken by take_logprobs() start at _logprobs_taken.
        self.logprobs: list[TokenLogprob] = []
        self._logprobs_taken = 0
        # The prompt tokens' after the first, when the request asked (prompt_logprobs); they
        # come with the first token.
        self.prompt_logprobs: list[TokenLogprob] = []
        self.chunk_sizes: list[int] = []  # tokens per arrival, so a cached replay matches them
        # The response cache (coordinator/response_cache.py): None when it is off, else "hit"
        # (replayed: no worker, no vLLM series), "miss" or "bypass"; on_finish stores a miss
        # once it finished normally (close()).
        self.cache: str | None = None
        self.on_finish: Callable[[Generation], None] | None = None
        self._flow = flow
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._release = release
        self._pieces: AsyncIterator[str] | None = None
        self._closed = False

    @property
    def wants_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def take_logprobs(self) -> list[dict]:
        """The entries that arrived since the last call, in the shape of Ollama's `logprobs`
        and OpenAI chat's `logprobs.content` (coordinator/logprobs.py): a stream attaches them
        to the chunk it sends next (a piece's text may lag its tokens; the final chunk takes
        the rest)."""
        return content_entries(self._tokenizer, self._take())

    def take_completion_logprobs(self, offset: int) -> dict:
        """take_logprobs in OpenAI completions' shape; `offset`: characters sent before."""
        return completion_logprobs(self._tokenizer, self._take(), offset)

    def prompt_completion_logprobs(self, prompt_ids: list[int]) -> dict:
        """The prompt's entries in OpenAI completions' shape (echo), the first token's null."""
        return prompt_completion_logprobs(self._tokenizer, prompt_ids, self.prompt_logprobs)

    def _take(self) -> list[TokenLogprob]:
        new = self.logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.logprobs)
        return new

    def pieces(self) -> AsyncIterator[str]:
        if self._pieces is not None:
            raise RuntimeError("Generation.pieces() may be iterated only once")
        self._pieces = self._run()
        return self._pieces

    async def _run(self) -> AsyncIterator[str]:
        text = TextStream(self._tokenizer, self.request.params.stop)
        try:
            async with aclosing(self._flow.stream(self.request, self.outcome)) as tokens:
                async for token_ids in tokens:
                    piece, stopped = text.push(token_ids)
                    self.output_ids.extend(token_ids)
                    self.chunk_sizes.append(len(token_ids))
                    self.logprobs.extend(token_ids.logprobs)
                    self.prompt_logprobs.extend(token_ids.prompt_logprobs)
                    self.timings.on_tokens(len(token_ids))
                    if piece:
                        yield piece
                    if stopped:  # leaving the `async with` cancels the worker's stream
                        self.done_reason = "stop"
                        return
            tail = text.finish()
            if tail:
                yield tail
            self.done_reason = self.outcome.finish_reason
        except WorkerError as exc:
            self.error = str(exc)
            log.error("request %s failed: %s", self.request.request_id, exc)
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pieces is not None:
                await self._pieces.aclose()
        finally:
            self._release()
            self.timings.finish()
            self.timings.cached_tokens = self.outcome.cached_tokens
            self.timings.prefill_worker_s = self.outcome.prefill_seconds
            outcome = self.done_reason or ("error" if self.error else "cancelled")
            if self.on_finish is not None and self.done_reason and self.error is None:
                self.on_finish(self)
            if self.cache == "hit":  # counted by the cache's own series only
                log.info("request %s: %s, %d output tokens from the response cache",
                         self.request.request_id, outcome, self.timings.output_tokens)
                return
            self._metrics.observe_request(self.timings, outcome)
            flow = self.outcome
            self._metrics.observe_transfer(flow.decode_worker, flow.kv_bytes,
                                           bool(flow.prefill_worker), flow.migrations)
            log.info("request %s: %s, %d prompt + %d output tokens, decode %s, prefill %s (%s), "
                     "%d KV bytes moved, %d migrations", self.request.request_id, outcome,
                     self.timings.prompt_tokens, self.timings.output_tokens,
                     flow.decode_worker or "-", flow.prefill_worker or "local",
                     flow.placement_reason, flow.kv_bytes, flow.migrations)
