"""The per-worker step scheduler: which requests run in the next forward pass, and how many
of their tokens. Torch-free, so it is tested step by step without a model.

One rule covers chunked prefill, split-fuse and resumption after preemption: every pass has a
token budget (SchedulerConfig.max_num_batched_tokens). Running requests are served first, in
arrival order (a decode costs one token, an unfinished prefill its next chunk), then waiting
requests fill what is left of the budget, the last one cut into a chunk. A long prompt thus
spans several passes, short prompts pack into one pass beside the running decodes, and every
pass is about the same size.

When the KV pool cannot grow a running request, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prefix-cached blocks make that cheap when they survive).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start_pos: int  # == request.num_computed_tokens when scheduled
    num_tokens: int  # tokens of request.token_ids[start_pos:] in this pass
    samples: bool  # the pass reaches the request's last token, so it yields a new token

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted by this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 hold_finished_blocks: bool = False) -> None:
        self.config = config
        self.block_manager = block_manager
        # Prefill role: a request that finishes keeps its blocks (owner = request id) until
        # the worker has seen its KV transfer acknowledged and frees them itself.
        self.hold_finished_blocks = hold_finished_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # -- queue management ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def reserve_remote(self, request: Request) -> list[int] | None:
        """Decode side of a disaggregated request: reserves blocks for its whole prompt,
        which a prefill worker will fill, and parks it in WAITING_FOR_REMOTE_KV. The blocks
        come fresh, never from the prefix cache: a remote writer must not write into blocks
        that other requests share. Returns the block table, or None when the pool is full.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # +1: room for the first decoded token's KV, so admission never preempts at once.
        alloc = self.block_manager.allocate(request.request_id, request.prompt_token_ids,
                                            request.num_prompt_tokens + 1, use_prefix_cache=False)
        if alloc is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return alloc.block_ids

    def admit_prefilled(self, request_id: str, first_token: int) -> Request | None:
        """The request's prompt KV has arrived and the prefill worker sampled `first_token`:
        it joins the running batch, its next pass a one-token decode."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.commit(request_id, request.token_ids, request.num_computed_tokens)
        request.append_token(first_token)
        request.status = RequestStatus.RUNNING
        status = request.check_stop()
        if status is not None:
            self.finish_request(request_id, status)
        else:
            self.running.append(request)
        return request

    def finish_request(self, request_id: str, status: RequestStatus,
                       free_blocks: bool = True) -> Request | None:
        """Ends a request in any state and, unless told otherwise, frees every block it holds.
        Unknown or already finished ids are ignored (an abort may race with a natural finish).
        free_blocks=False leaves the blocks with the request id as owner: the prefill worker
        keeps them until the decode worker has acknowledged their transfer, then frees them.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if free_blocks:
            self.block_manager.free(request_id)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_schedulable(self) -> bool:
        """Work a pass could do now (requests waiting for remote KV have none)."""
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the step ------------------------------------------------------------------------

    def _chunk_limit(self, budget: int, request: Request) -> int:
        """The most tokens `request` may compute in this pass: what is left of the budget,
        capped by the worker's chunk limit and the request's own (the coordinator's plan)."""
        for cap in (self.config.long_prefill_token_threshold, request.max_chunk_tokens):
            if cap:
                budget = min(budget, cap)
        return budget

    @staticmethod
    def _chunk(request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, n, samples=start + n == request.num_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running requests, oldest first. The victim of a preemption is the newest running
        #    request that is not yet scheduled in this pass (possibly the request itself).
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            n = min(request.num_tokens - request.num_computed_tokens, self._chunk_limit(budget, request))
            while bm.allocate(request.request_id, request.token_ids,
                              request.num_computed_tokens + n) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk(request, n))
                budget -= n
                idx += 1
                continue
            break  # the request preempted itself: nothing smaller is left to evict

        # 2. Waiting requests fill the rest, unless this step had to preempt (the pool is
        #    full; admitting more would only thrash).
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if not bm.has(request.request_id):
                # First allocation looks up the prefix cache: cached tokens need no compute.
                probe = bm.allocate(request.request_id, request.token_ids,
                                    min(request.num_tokens, budget))
                if probe is None:
                    break
                request.num_computed_tokens = probe.num_cached_tokens
                if request.status is RequestStatus.WAITING:
                    request.num_cached_tokens = probe.num_cached_tokens
            n = min(request.num_tokens - request.num_computed_tokens, self._chunk_limit(budget, request))
            if bm.allocate(request.request_id, request.token_ids, request.num_computed_tokens + n) is None:
                bm.free(request.request_id)
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, n))
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Applies a finished pass: advances computed counts, registers full blocks in the
        prefix cache, appends sampled tokens, and finishes requests that hit a stop.
        Returns the requests finished by this update."""
        finished: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id not in self.requests:
                continue  # aborted while the pass ran; its blocks are already free
            request.num_computed_tokens = chunk.start_pos + chunk.num_tokens
            self.block_manager.commit(request.request_id, request.token_ids, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            status = request.check_stop()
            if status is not None:
                self.finish_request(request.request_id, status, free_blocks=not self.hold_finished_blocks)
                finished.append(request)
        return finished
