"""The decode worker: an engine in the decode (or colocated) role, with a DecodeConnector when
it receives KV from prefill workers. Transfer state lives on the requests and in the engine's
scheduler and connector (engine/kv_connector.py), not here.

A request's life cycle on this node:

  remote prefill (disaggregated):
    open()            -> engine thread: a request with kv_transfer(remote_prefill), queued.
    scheduled         -> blocks for the whole prompt (the leading ones from the prefix cache
                         when they are there), the fresh ones granted to the transfer:
                         WAITING_FOR_REMOTE_KV / kv_state RECEIVING. With the pool full it waits
                         in arrival order for blocks, up to reserve_timeout_s.
    KV + first token  -> the connector reports it received: RUNNING in the continuous batch,
                         the first token (sampled by the prefill worker) the next input. Each
                         step -> event Tokens (the first event also carries the KV bytes moved
                         and the prompt tokens this worker had cached).
    transfer failed   -> FINISHED_ERROR, event Tokens(finished, "error"); blocks held until the
                         receiver reports no writer remains, then freed.
    finished          -> blocks freed by the scheduler; event Tokens(finished)
    sampling failed   -> (no valid distribution for this request) FINISHED_ERROR, blocks freed,
                         event Tokens(finished, "error", error); the batch goes on
  local prefill (short prompts, colocated role):
    open()            -> add_request: WAITING, prefilled in chunks inside the decode batch
                         (split-fuse), then decoded as above. Its first token is in the stream.
  embedding (Embed RPC, one request per input):
    embed()           -> engine thread: a pooling request (make_embedding_request), queued;
                         prefilled in chunks inside the decode batch like a local prompt, its
                         hidden states summed pass by pass; finished once the whole prompt is
                         computed: the pooled vector goes to the caller, blocks freed.
    caller cancelled  -> (client gone) every input not yet finished is aborted, blocks freed.
  abort (client gone, stop string, coordinator cancel) in any state:
    the request ends; blocks a transfer may still write stay held until the receiver reports
    them released (the sender acknowledged, or its process is gone), then they are freed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from decode_node.connector import DecodeConnector
from worker.embedder import Embedder
from worker.engine_loop import EngineLoop
from common.errors import TandemError
from engine.kv_transfer_state import KVTransferParams
from engine.llm_engine import LLMEngine
from engine.step_output import StepOutput
from engine.request import RequestStatus
from engine.request_grammar import RequestGrammar
from common.pooling import Pooling
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class DecodeJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int
    remote_prefill: bool
    max_chunk_tokens: int = 0  # the coordinator's chunk plan for a local prefill; 0 = ours
    transfer_id: str = ""  # remote prefill: the KV transfer's id ("" = request_id)
    num_prior_output_tokens: int = 0  # migrated: trailing prompt tokens generated earlier
    cache_salt: bytes = b""  # the prefix-cache tenant (common/block_hash.py)
    log_id: str = ""  # the client's request id, for log lines written on the engine thread
    passes: list | None = None  # traces on: the engine's PassRecords of this request go here


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    num_cached_tokens: int = 0
    kv_bytes_received: int = 0
    logprobs: list | None = None  # common.logprobs.TokenLogprob per token, when asked for
    prompt_logprobs: list | None = None  # local prefill, first event: the prompt tokens', when asked for


class DecodeWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, receiver=None,
                 kv_backend: str = "", kv_deadline_s: float = 330.0,
                 kv_endpoint: str = "", reserve_timeout_s: float = 25.0) -> None:
        if engine.config.role == "prefill":
            raise ValueError("a decode worker needs an engine in the decode or colocated role, "
                             "not one holding only the prefill format")
        super().__init__(engine, loop, name="decode-engine")
        self.receiver = receiver
        self.kv_backend = kv_backend
        # Where prefill workers reach the receiver: its bound endpoint with a wildcard host
        # replaced by the advertised one (empty: the receiver's own endpoint).
        self.kv_endpoint = kv_endpoint or (receiver.endpoint if receiver is not None else "")
        self.connector: DecodeConnector | None = None
        if receiver is not None:
            self.connector = DecodeConnector(receiver, engine.config.model.num_layers,
                                             engine.config.cache.block_size, kv_deadline_s)
            engine.set_connector(self.connector)
        # Waiting for free blocks; shorter than the coordinator's wait for the prefill.
        self.reserve_timeout_s = reserve_timeout_s
        self._streams: dict[str, asyncio.Queue] = {}  # asyncio thread only
        self._first_event: set[str] = set()  # engine thread: remote requests not yet reported
        self.embedder = Embedder(self)  # embedding inputs, pooled beside the decodes
        self._grammar_tasks: set[asyncio.Task] = set()  # requests whose grammar is compiling

    # -- asyncio side --------------------------------------------------------------------

    def open(self, job: DecodeJob) -> asyncio.Queue:
        self.check_alive()
        self.engine.require_resident()  # ResidencyError; _admit checks again on the engine thread
        q: asyncio.Queue = asyncio.Queue()
        self._streams[job.request_id] = q
        if job.params.grammar is None:
            self.call(lambda: self._admit(job, None))
        else:  # compiled off the engine thread first; the batch goes on meanwhile
            task = self.loop.create_task(self._admit_with_grammar(job))
            self._grammar_tasks.add(task)
            task.add_done_callback(self._grammar_tasks.discard)
        return q

    async def _admit_with_grammar(self, job: DecodeJob) -> None:
        try:
            grammar = await self.grammar_for(job.params, job.stop_token_ids)
        except (TandemError, ValueError) as exc:
            self._deliver(job.request_id, Tokens([], True, "error", str(exc)))
            return
        if job.request_id in self._streams:  # else the consumer left while it compiled
            self.call(lambda: self._admit(job, grammar))

    async def embed(self, inputs: list[list[int]], normalize: bool = True,
                    max_chunk_tokens: int = 0,
                    pooling: Pooling = Pooling.MEAN) -> list[list[float]]:
        """Pooled embeddings of `inputs`, scheduled beside the running decodes
        (worker/embedder.py)."""
        return await self.embedder.embed(inputs, normalize, max_chunk_tokens, pooling)

    def close_stream(self, request_id: str) -> None:
        """The consumer is gone: abort whatever is left of the request."""
        if self._streams.pop(request_id, None) is not None:
            self.call(lambda: self._end(request_id))

    def _deliver(self, request_id: str, event: Tokens) -> None:
        q = self._streams.get(request_id)
        if q is None:
            return
        q.put_nowait(event)
        if event.finished:
            self._streams.pop(request_id, None)

    # -- engine thread -------------------------------------------------------------------

    def _emit(self, request_id: str, event: Tokens) -> None:
        self.post(self._deliver, request_id, event)

    def _admit(self, job: DecodeJob, grammar: RequestGrammar | None) -> None:
        engine = self.engine
        try:
            engine.require_resident()  # an unload may have run since open()
            request = engine.make_request(job.prompt_token_ids, job.params, job.request_id,
                                          job.stop_token_ids, job.max_tokens, job.max_chunk_tokens,
                                          job.num_prior_output_tokens)
            request.grammar = grammar
            request.cache_salt = job.cache_salt
            request.log_id, request.passes = job.log_id, job.passes
            if job.remote_prefill:
                if self.connector is None:
                    raise TandemError("this worker has no KV receiver; it cannot take remote prefills")
                request.kv_transfer = KVTransferParams(job.transfer_id or job.request_id,
                                                       remote_prefill=True)
                self._first_event.add(job.request_id)
            engine.submit(request)
        except (TandemError, ValueError) as exc:
            self._first_event.discard(job.request_id)
            self._emit(job.request_id, Tokens([], True, "error", str(exc)))

    def poll(self) -> None:
        """Remote requests still waiting for blocks past reserve_timeout_s fail: the pool has
        been full that long, and the coordinator can place them elsewhere."""
        if not self._first_event:
            return
        now = time.monotonic()
        for request in list(self.engine.scheduler.waiting):
            if (request.kv_transfer is not None and request.status is RequestStatus.WAITING
                    and now - request.arrival_time > self.reserve_timeout_s):
                self._end(request.request_id, RequestStatus.FINISHED_ERROR)
                self._emit(request.request_id, Tokens([], True, "error", (
                    f"decode worker had no free KV blocks for {self.reserve_timeout_s:.0f} s")))

    def _end(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self._first_event.discard(request_id)
        if self.connector is not None:
            self.connector.expected_bytes.pop(request_id, None)
        self.engine.abort_request(request_id, status)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in self.embedder.take(outputs):
            reason = (out.status.done_reason or "") if out.finished else ""
            kv_bytes = 0
            if out.request_id in self._first_event:
                self._first_event.discard(out.request_id)
                if self.connector is not None:
                    kv_bytes = self.connector.expected_bytes.pop(out.request_id, 0)
            self._emit(out.request_id, Tokens(out.new_token_ids, out.finished, reason, out.error,
                                              num_cached_tokens=out.num_cached_tokens,
                                              kv_bytes_received=kv_bytes, logprobs=out.logprobs,
                                              prompt_logprobs=out.prompt_logprobs))

    def on_fatal(self, exc: BaseException) -> None:
        def fail_all() -> None:
            for rid in list(self._streams):
                self._deliver(rid, Tokens([], True, "error", f"decode engine failed: {exc}"))
            self.embedder.fail_all(exc)
        self.post(fail_all)
