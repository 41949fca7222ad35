"""The prefill worker: an engine in the prefill role with a PrefillConnector. It only sends KV;
it never decodes. Transfer state lives on the requests and in the engine's scheduler and
connector (engine/kv_connector.py, prefill_node/connector.py), not here.

A request's life cycle on this node:

  prefill(job)      -> asyncio side: a KVSender connected to the decode worker's endpoint
                       (connect handshakes the layout; a mismatch fails the request before any
                       compute); engine thread: add_request with max_tokens = 1 and
                       kv_transfer(transfer id, that sender). The decode worker reserves its
                       blocks at the same time and grants them to the transfer; the sender asks
                       for the grant itself, so compute starts without waiting for it.
  each pass         -> the request's chunk is packed with others under the token budget
                       (chunked prefill / split-fuse). Right after each layer's K/V is written,
                       the connector hands the blocks that chunk completed to the sender, whose
                       own thread gathers and transmits them while layer i+1 computes.
  first token       -> sampled after the last chunk and returned at once (TTFT does not wait
                       for the transfer); it also goes to the decode worker with the last
                       layer's KV (sender.finish). The request is finished; its blocks stay
                       held (kv_state DRAINING) until the sender reports the transfer terminal.
  sampling failed   -> (no valid distribution for the first token) the transfer is aborted,
                       Prefill fails INVALID_ARGUMENT with the reason; the batch goes on.
  abort (RPC cancelled) in any state: the request ends, the transfer is aborted (the decode
                       worker learns it at once) and the blocks are freed once the sender
                       reads them no more.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from worker.embedder import Embedder
from worker.engine_loop import EngineLoop
from common.errors import SamplingError, TandemError
from engine.kv_transfer_state import KVTransferParams
from engine.llm_engine import LLMEngine
from engine.step_output import StepOutput
from engine.request import RequestStatus
from engine.request_grammar import RequestGrammar
from common.sampling_params import SamplingParams
from prefill_node.connector import PrefillConnector


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    transfer_id: str = ""  # "" = request_id
    max_chunk_tokens: int = 0  # the coordinator's chunk plan; 0 = this worker's limit
    num_prior_output_tokens: int = 0  # migrated: trailing prompt tokens generated earlier
    cache_salt: bytes = b""  # the prefix-cache tenant (common/block_hash.py)
    stop_token_ids: frozenset[int] = frozenset()  # the request's, for min_tokens and grammar
    log_id: str = ""  # the client's request id, for log lines written on the engine thread
    passes: list | None = None  # traces on: the engine's PassRecords of this request go here
    span: Any = None  # traces on: the span the KV transfer's spans hang under


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    num_cached_tokens: int
    seconds: float
    logprobs: list | None = None  # [common.logprobs.TokenLogprob] of the first token, when asked for
    prompt_logprobs: list | None = None  # the prompt tokens' after the first, when asked for


class PrefillWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_transfer_end=None) -> None:
        if engine.config.role == "decode":
            raise ValueError("a prefill worker needs an engine in the prefill (or colocated) role, "
                             "not one holding only the decode format")
        super().__init__(engine, loop, name="prefill-engine")
        self.connector = PrefillConnector(engine.runner.kv_cache, engine.config.cache.block_size,
                                          engine.block_manager.block_table, on_transfer_end)
        engine.set_connector(self.connector)
        self._futures: dict[str, asyncio.Future] = {}  # asyncio thread only
        self.embedder = Embedder(self)  # embedding inputs, chunked like prompts
        self._started: dict[str, float] = {}

    # -- asyncio side --------------------------------------------------------------------

    async def prefill(self, job: PrefillJob, sender) -> PrefillOutcome:
        self.check_alive()
        self.engine.require_resident()  # ResidencyError; _admit checks again on the engine thread
        started = time.monotonic()
        try:  # compiled off the engine thread, before the request reaches it
            grammar = await self.grammar_for(job.params, job.stop_token_ids)
        except (TandemError, ValueError) as exc:
            sender.abort(job.transfer_id or job.request_id, f"prefill refused the request: {exc}")
            raise
        future = self.loop.create_future()
        self._futures[job.request_id] = future
        self._started[job.request_id] = started
        self.call(lambda: self._admit(job, sender, grammar))
        try:
            return await future
        except asyncio.CancelledError:
            self.call(lambda: self.engine.abort_request(job.request_id))
            raise
        finally:
            self._futures.pop(job.request_id, None)
            self._started.pop(job.request_id, None)

    def _resolve(self, request_id: str, result: PrefillOutcome | BaseException) -> None:
        future = self._futures.get(request_id)
        if future is None or future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            started = self._started.get(request_id, time.monotonic())
            future.set_result(PrefillOutcome(result.first_token, result.num_cached_tokens,
                                             time.monotonic() - started, result.logprobs,
                                             result.prompt_logprobs))

    # -- engine thread -------------------------------------------------------------------

    def _admit(self, job: PrefillJob, sender, grammar: RequestGrammar | None) -> None:
        try:
            self.engine.require_resident()  # an unload may have run since prefill()
            request = self.engine.make_request(job.prompt_token_ids, job.params, job.request_id,
                                               stop_token_ids=job.stop_token_ids, max_tokens=1,
                                               max_chunk_tokens=job.max_chunk_tokens,
                                               num_prior_output_tokens=job.num_prior_output_tokens)
            request.grammar = grammar
            request.cache_salt = job.cache_salt
            request.log_id, request.passes = job.log_id, job.passes
            request.kv_transfer = KVTransferParams(job.transfer_id or job.request_id, peer=sender,
                                                   trace=job.span)
            self.engine.submit(request)
        except (TandemError, ValueError) as exc:
            # Tell the decode worker at once rather than let its reservation wait out.
            sender.abort(job.transfer_id or job.request_id, f"prefill refused the request: {exc}")
            self.post(self._resolve, job.request_id, exc)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in self.embedder.take(outputs):
            if out.error:
                self.post(self._resolve, out.request_id, SamplingError(out.error))
            elif out.new_token_ids:
                self.post(self._resolve, out.request_id,
                          PrefillOutcome(out.new_token_ids[0], out.num_cached_tokens, 0.0,
                                         out.logprobs, out.prompt_logprobs))
            elif out.status is RequestStatus.FINISHED_ERROR:
                self.post(self._resolve, out.request_id, TandemError("prefill failed"))

    def on_fatal(self, exc: BaseException) -> None:
        def fail_all() -> None:
            for rid in list(self._futures):
                self._resolve(rid, RuntimeError(f"prefill engine failed: {exc}"))
            self.embedder.fail_all(exc)
        self.post(fail_all)
