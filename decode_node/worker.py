"""The decode worker: an engine in the decode (or colocated) role.

A request's life cycle on this node:

  remote prefill (disaggregated):
    open()            -> engine thread: make_request, reserve_remote (fresh blocks for the
                         whole prompt), receiver.expect(blocks)  -> event Reserved
                         state WAITING_FOR_REMOTE_KV. With the pool full, the reservation
                         waits in arrival order until blocks free up (reserve_timeout_s).
    KV arrives        -> receiver.poll() COMPLETE                 (a FAILED ends the request)
    start_decode(tok) -> the prefill worker's first token
    both known        -> admit_prefilled: RUNNING in the continuous batch; the first token is
                         the next input. Each step -> event Tokens
    finished          -> blocks freed by the scheduler; event Tokens(finished)
    sampling failed   -> (no valid distribution for this request) FINISHED_ERROR, blocks freed,
                         event Tokens(finished, "error", error); the batch goes on
  local prefill (short prompts, colocated role):
    open()            -> add_request: WAITING, prefilled in chunks inside the decode batch
                         (split-fuse), then decoded as above. Its first token is in the stream.
  abort (client gone, stop string, coordinator cancel) in any state:
    receiver.cancel + finish_request: every block freed. A request cancelled while its KV may
    still be landing (shm writes are one-sided) keeps its blocks for `quarantine_s` first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from engine.engine_loop import EngineLoop
from engine.errors import TandemError
from engine.llm_engine import LLMEngine, StepOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class DecodeJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int
    remote_prefill: bool
    max_chunk_tokens: int = 0  # the coordinator's chunk plan for a local prefill; 0 = ours


@dataclass(frozen=True)
class Reserved:
    block_ids: list[int]
    kv_endpoint: str
    kv_backend: str


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    num_cached_tokens: int = 0


class DecodeWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, receiver=None,
                 kv_backend: str = "", kv_deadline_s: float = 330.0, quarantine_s: float = 0.05,
                 kv_endpoint: str = "", reserve_timeout_s: float = 25.0) -> None:
        if engine.config.role == "prefill":
            raise ValueError("a decode worker needs an engine in the decode or colocated role, "
                             "not one holding only the prefill format")
        super().__init__(engine, loop, name="decode-engine")
        self.receiver = receiver
        self.kv_backend = kv_backend
        # Where prefill workers reach the receiver: its bound endpoint with a wildcard host
        # replaced by the advertised one (empty: the receiver's own endpoint).
        self.kv_endpoint = kv_endpoint
        # From reservation until all KV has landed; longer than the coordinator's prefill
        # deadline, so a slow but live prefill is never cut off here first.
        self.kv_deadline_s = kv_deadline_s
        self.quarantine_s = quarantine_s
        # Waiting for free blocks; shorter than the coordinator's wait for the reservation.
        self.reserve_timeout_s = reserve_timeout_s
        self._parked: deque[tuple[float, Request]] = deque()  # engine thread only
        self._streams: dict[str, asyncio.Queue] = {}  # asyncio thread only
        # engine thread only:
        self._remote: set[str] = set()  # reserved, KV not yet complete
        self._kv_ready: set[str] = set()
        self._first_token: dict[str, int] = {}
        self._quarantine: list[tuple[float, str]] = []

    # -- asyncio side --------------------------------------------------------------------

    def open(self, job: DecodeJob) -> asyncio.Queue:
        self.check_alive()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[job.request_id] = q
        self.call(lambda: self._admit(job))
        return q

    def close_stream(self, request_id: str) -> None:
        """The consumer is gone: abort whatever is left of the request."""
        if self._streams.pop(request_id, None) is not None:
            self.call(lambda: self._abort(request_id))

    def start_decode(self, request_id: str, first_token: int | None, error: str = "") -> None:
        self.call(lambda: self._start(request_id, first_token, error))

    def _deliver(self, request_id: str, event) -> None:
        q = self._streams.get(request_id)
        if q is None:
            return
        q.put_nowait(event)
        if isinstance(event, Tokens) and event.finished:
            self._streams.pop(request_id, None)

    # -- engine thread -------------------------------------------------------------------

    def _emit(self, request_id: str, event) -> None:
        self.post(self._deliver, request_id, event)

    def _admit(self, job: DecodeJob) -> None:
        engine = self.engine
        try:
            request = engine.make_request(job.prompt_token_ids, job.params, job.request_id,
                                          job.stop_token_ids, job.max_tokens, job.max_chunk_tokens)
            if not job.remote_prefill:
                engine.submit(request)
                return
            if self.receiver is None:
                raise TandemError("this worker has no KV receiver; it cannot take remote prefills")
            blocks = engine.reserve_remote(request)
        except (TandemError, ValueError) as exc:
            self._emit(job.request_id, Tokens([], True, "error", str(exc)))
            return
        if blocks is None:
            # The pool is full: the reservation waits (in arrival order) for blocks to free up,
            # up to reserve_timeout_s, instead of failing the request at once.
            self._parked.append((time.monotonic() + self.reserve_timeout_s, request))
            return
        self._reserved(request, blocks)

    def _reserved(self, request: Request, blocks: list[int]) -> None:
        # The table may hold one block more than the prompt (room for the first decoded
        # token); the prefill worker fills, and the receiver expects, the prompt's blocks only.
        bs = self.engine.config.cache.block_size
        blocks = blocks[:-(-request.num_prompt_tokens // bs)]
        request_id = request.request_id
        self.receiver.expect(request_id, blocks, self.engine.config.model.num_layers, self.kv_deadline_s)
        self._remote.add(request_id)
        self._emit(request_id, Reserved(blocks, self.kv_endpoint or self.receiver.endpoint, self.kv_backend))

    def _retry_parked(self) -> None:
        now = time.monotonic()
        while self._parked:
            deadline, request = self._parked[0]
            blocks = self.engine.reserve_remote(request)
            if blocks is not None:
                self._parked.popleft()
                self._reserved(request, blocks)
            elif now >= deadline:
                self._parked.popleft()
                self._emit(request.request_id, Tokens([], True, "error", (
                    f"decode worker had no free KV blocks for {self.reserve_timeout_s:.0f} s")))
            else:
                return

    def _start(self, request_id: str, first_token: int | None, error: str) -> None:
        if request_id not in self.engine.scheduler.requests:
            return
        if error or first_token is None:
            self._fail(request_id, error or "prefill failed")
            return
        self._first_token[request_id] = first_token
        self._try_admit(request_id)

    def _try_admit(self, request_id: str) -> None:
        if request_id not in self._kv_ready or request_id not in self._first_token:
            return
        self._kv_ready.discard(request_id)
        request = self.engine.admit_prefilled(request_id, self._first_token.pop(request_id))
        if request is not None and request.status.is_finished:
            self._emit(request_id, Tokens([], True, request.status.done_reason or ""))

    def poll(self) -> None:
        if self.receiver is not None:
            for event in self.receiver.poll():
                rid = event.request_id
                if rid not in self._remote:
                    continue
                if event.kind.value == "complete":
                    self._remote.discard(rid)
                    self._kv_ready.add(rid)
                    self._try_admit(rid)
                else:  # still counted as landing, so _end quarantines its blocks
                    self._fail(rid, f"KV transfer failed: {event.reason}")
        if self._parked:
            self._retry_parked()
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.engine.block_manager.free(self._quarantine.pop(0)[1])

    def _end(self, request_id: str, status: RequestStatus) -> None:
        landing = request_id in self._remote  # its KV may still be arriving
        self._remote.discard(request_id)
        self._kv_ready.discard(request_id)
        self._first_token.pop(request_id, None)
        if self.receiver is not None and landing:
            self.receiver.cancel(request_id)
        self.engine.abort_request(request_id, status, free_blocks=not landing)
        if landing:
            self._quarantine.append((time.monotonic() + self.quarantine_s, request_id))

    def _fail(self, request_id: str, reason: str) -> None:
        self._end(request_id, RequestStatus.FINISHED_ERROR)
        self._emit(request_id, Tokens([], True, "error", reason))

    def _abort(self, request_id: str) -> None:
        self._parked = deque((d, r) for d, r in self._parked if r.request_id != request_id)
        self._end(request_id, RequestStatus.FINISHED_ABORTED)

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            reason = (out.status.done_reason or "") if out.finished else ""
            self._emit(out.request_id, Tokens(out.new_token_ids, out.finished, reason, out.error,
                                              num_cached_tokens=out.num_cached_tokens))

    def on_fatal(self, exc: BaseException) -> None:
        def fail_all() -> None:
            for rid in list(self._streams):
                self._deliver(rid, Tokens([], True, "error", f"decode engine failed: {exc}"))
        self.post(fail_all)
