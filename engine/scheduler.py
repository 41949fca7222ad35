"""The per-worker step scheduler: which requests run in the next forward pass, and how many
of their tokens. Torch-free, so it is tested step by step without a model.

One rule covers chunked prefill, split-fuse and resumption after preemption: every pass has a
token budget (SchedulerConfig.max_num_batched_tokens). Running requests are served first, in
arrival order (a decode costs one token, an unfinished prefill its next chunk), then waiting
requests fill what is left of the budget, the last one cut into a chunk. A long prompt thus
spans several passes, short prompts pack into one pass beside the running decodes, and every
pass is about the same size.

A waiting request whose KV comes from another worker (the connector says how many of its
tokens will arrive) is not computed: it gets blocks for its whole prompt, the leading ones from
the prefix cache, and waits in WAITING_FOR_REMOTE_KV until the connector reports its KV and
first token in; it then joins the running requests. A request that ends while a transfer may
still touch its blocks keeps them (`draining`) until the connector reports them released.

When the KV pool cannot grow a running request, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prefix-cached blocks make that cheap when they survive).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.kv_connector import ConnectorEvents, KVConnector
from engine.kv_transfer_state import KVTransferState
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledChunk, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 connector: KVConnector | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        # The engine's KV connector (engine/kv_connector.py), or None: no request transfers.
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # WAITING_FOR_REMOTE_KV: blocks reserved, the connector reports when the KV is in.
        self.waiting_for_kv: dict[str, Request] = {}
        # Ended requests whose blocks a transfer may still touch (kv_state DRAINING): they
        # keep their blocks, owned under their id, until the connector reports them released.
        self.draining: dict[str, Request] = {}

    # -- queue management ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request in any state and frees every block it holds, unless the connector
        says a transfer may still touch them: then they stay owned by the request id
        (kv_state DRAINING) until update_from_connector sees it released. Unknown or already
        finished ids are ignored (an abort may race with a natural finish)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.waiting_for_kv.pop(request_id, None)
        request.status = status
        if (self.connector is not None and request.kv_transfer is not None
                and self.connector.request_finished(request)):
            request.kv_state = KVTransferState.DRAINING
            self.draining[request_id] = request
        else:
            self.block_manager.free(request_id)
            if request.kv_state is not KVTransferState.NONE:
                request.kv_state = KVTransferState.RELEASED
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_transfers(self) -> bool:
        """Requests whose progress only the connector can report (KV landing, or blocks held
        while a transfer drains)."""
        return bool(self.waiting_for_kv or self.draining)

    def update_from_connector(self, events: ConnectorEvents) -> list[tuple[Request, str]]:
        """Applies what the connector reported since the last step: a request whose KV and
        first token arrived joins the running batch (its next pass a one-token decode, or it
        finishes at once if that token ends it); a failed transfer ends its request; a
        released request's blocks are freed. Returns the requests this ended, with the error
        ("" for a natural finish)."""
        ended: list[tuple[Request, str]] = []
        for request_id, first_token in events.received.items():
            request = self.waiting_for_kv.pop(request_id, None)
            if request is None:
                continue  # aborted meanwhile; its blocks drain
            request.kv_state = KVTransferState.RECEIVED
            request.num_computed_tokens = request.num_prompt_tokens
            self.block_manager.commit(request_id, request.token_ids, request.num_computed_tokens)
            request.append_token(first_token)
            request.status = RequestStatus.RUNNING
            status = request.check_stop()
            if status is not None:
                self.finish_request(request_id, status)
                ended.append((request, ""))
            else:
                self.running.append(request)
        for request_id, reason in events.failed.items():
            request = self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                ended.append((request, reason))
        for request_id in events.released:
            request = self.draining.pop(request_id, None)
            if request is not None:
                self.block_manager.free(request_id)
                request.kv_state = KVTransferState.RELEASED
        return ended

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
    def _chunk(request: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, n,
                              samples=start + n == request.num_tokens and not request.pooling,
                              draft_token_ids=draft)

    @staticmethod
    def _draft_for(request: Request, n: int, budget: int) -> tuple[int, ...]:
        """The request's draft tokens for this pass, consumed (a draft is proposed for one
        schedule only): only behind its last token, and cut to the budget left after n."""
        draft, request.draft_token_ids = request.draft_token_ids, []
        if not draft or request.num_computed_tokens + n != request.num_tokens:
            return ()
        return tuple(draft[:max(0, budget - n)])

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
        #    A request with draft tokens (speculative decoding) costs 1 + its drafts, which
        #    are cut to the budget left and dropped first when the pool is short: they are
        #    optional, preempting another request for them is not.
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            n = min(request.num_tokens - request.num_computed_tokens, self._chunk_limit(budget, request))
            draft = self._draft_for(request, n, budget)
            if draft and bm.allocate(request.request_id, request.token_ids,
                                     request.num_computed_tokens + n + len(draft)) is None:
                draft = ()
            while bm.allocate(request.request_id, request.token_ids,
                              request.num_computed_tokens + n) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.chunks.append(self._chunk(request, n, draft))
                budget -= n + len(draft)
                idx += 1
                continue
            break  # the request preempted itself: nothing smaller is left to evict

        # 2. Waiting requests fill the rest, unless this step had to preempt (the pool is
        #    full; admitting more would only thrash).
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if (request.kv_transfer is not None and self.connector is not None
                    and request.status is RequestStatus.WAITING and not bm.has(request.request_id)):
                remote = self.connector.get_num_new_matched_tokens(
                    request, bm.cached_prefix_len(request.token_ids, request.cache_salt))
                if remote > 0:
                    if not self._reserve_remote(request):
                        break  # in arrival order: it waits for blocks, and so do those behind it
                    continue
            if not bm.has(request.request_id):
                # First allocation looks up the prefix cache: cached tokens need no compute.
                # Not for prompt logprobs: those need every prompt position's logits, which
                # cached positions lack, so the whole prompt is recomputed.
                # Nor for embeddings: pooling needs every prompt position's hidden state.
                probe = bm.allocate(request.request_id, request.token_ids,
                                    min(request.num_tokens, budget),
                                    use_prefix_cache=request.sampling_params.prompt_logprobs is None
                                    and not request.pooling, salt=request.cache_salt)
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

    def _reserve_remote(self, request: Request) -> bool:
        """Blocks for the whole prompt (+1 slot: the first decoded token's KV, so admission
        never preempts at once), the leading ones from the prefix cache when they are there:
        shared blocks are read-only, so the remote writes only the fresh ones after them."""
        alloc = self.block_manager.allocate(request.request_id, request.token_ids,
                                            request.num_prompt_tokens + 1, salt=request.cache_salt)
        if alloc is None:
            return False
        self.waiting.popleft()
        request.num_cached_tokens = alloc.num_cached_tokens
        request.num_computed_tokens = alloc.num_cached_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[request.request_id] = request
        self.connector.update_state_after_alloc(request, alloc.block_ids, alloc.num_cached_tokens)
        return True

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Applies a finished pass: advances computed counts, registers full blocks in the
        prefix cache, appends sampled tokens, and finishes requests that hit a stop.
        Returns the requests finished by this update.

        sampled: request id -> its new token, or for a chunk with drafts its verified run
        (engine/rejection_sampler.py): the accepted drafts, then the target's own token.
        A run's tokens are appended one by one with the stop checked after each, so a stop
        inside an accepted run ends the request there and the rest is dropped. The KV of
        rejected drafts is rolled back: the computed count covers the accepted ones only,
        and blocks allocated only for the rejected tail are freed."""
        finished: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.request_id not in self.requests:
                continue  # aborted while the pass ran; its blocks are already free
            token = sampled.get(request.request_id)
            run = [token] if isinstance(token, int) else list(token or ())
            accepted = max(0, len(run) - 1) if chunk.draft_token_ids else 0
            if list(chunk.draft_token_ids[:accepted]) != run[:accepted]:
                raise RuntimeError(f"request {request.request_id!r}: the run {run} does not "
                                   f"start with its draft {list(chunk.draft_token_ids)}")
            request.num_computed_tokens = chunk.start_pos + chunk.num_tokens + accepted
            if not request.pooling:  # an embedding input never enters the shared prefix cache
                self.block_manager.commit(request.request_id, request.token_ids,
                                          request.num_computed_tokens)
            if request.pooling and request.num_computed_tokens >= request.num_prompt_tokens:
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
                continue
            status = None
            for token in run:
                request.append_token(token)
                status = request.check_stop()
                if status is not None:
                    break
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
            elif chunk.draft_token_ids:
                # The next pass writes the last token's slot, num_tokens - 1: keep the blocks
                # up to it, free the rest (allocated for drafts that were rejected).
                self.block_manager.trim(request.request_id, request.num_tokens)
        return finished
