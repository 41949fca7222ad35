"""The prefill worker: an engine in the prefill role. It only sends KV; it never decodes.

A request's life cycle on this node:

  prefill(job)      -> asyncio side: a KVSender connected to the decode worker's endpoint
                       (connect handshakes the layout; a mismatch fails the request before any
                       compute); engine thread: add_request with max_tokens = 1
  each pass         -> the request's chunk is packed with others under the token budget
                       (chunked prefill / split-fuse). Right after each layer's K/V is written,
                       the blocks that chunk completed are gathered and handed to the sender,
                       so the transfer of layer i overlaps the compute of layer i+1.
                       Block rule: a non-final chunk sends only the blocks it filled completely;
                       the final chunk sends the rest, the partial last block included. So
                       every destination block is written exactly once per layer, and the
                       receiver's "all blocks of all layers arrived" means the KV is complete.
  first token       -> sampled after the last chunk and returned at once (TTFT does not wait
                       for the transfer). The request is finished but its blocks stay held.
  transfer acked    -> sender.poll DONE or FAILED: the blocks are freed.
  sampling failed   -> (no valid distribution for the first token) the blocks are freed at once
                       and Prefill fails INVALID_ARGUMENT with the reason; the batch goes on.
  abort (RPC cancelled) in any state: the request ends and its blocks are freed at once (the
                       payloads in flight are copies, so nothing reads those blocks again).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from engine.engine_loop import EngineLoop
from engine.errors import SamplingError, TandemError
from engine.llm_engine import LLMEngine, StepOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dst_block_ids: list[int]
    max_chunk_tokens: int = 0  # the coordinator's chunk plan; 0 = this worker's limit


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    num_cached_tokens: int
    seconds: float


@dataclass
class _Transfer:
    sender: object  # KVSender
    dst_block_ids: list[int]
    blocks_sent: int = 0  # leading destination blocks already handed to the sender


class PrefillWorker(EngineLoop):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        if engine.config.role == "decode":
            raise ValueError("a prefill worker needs an engine in the prefill (or colocated) role, "
                             "not one holding only the decode format")
        super().__init__(engine, loop, name="prefill-engine")
        engine.scheduler.hold_finished_blocks = True
        engine.layer_hook = self._layer_hook
        self._futures: dict[str, asyncio.Future] = {}  # asyncio thread only
        self._started: dict[str, float] = {}
        # engine thread only:
        self._transfers: dict[str, _Transfer] = {}  # computing: sends happen per layer
        self._draining: dict[str, _Transfer] = {}  # finished: waiting for acks, blocks held

    # -- asyncio side --------------------------------------------------------------------

    async def prefill(self, job: PrefillJob, sender) -> PrefillOutcome:
        self.check_alive()
        future = self.loop.create_future()
        self._futures[job.request_id] = future
        self._started[job.request_id] = time.monotonic()
        self.call(lambda: self._admit(job, sender))
        try:
            return await future
        except asyncio.CancelledError:
            self.call(lambda: self._abort(job.request_id))
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
                                             time.monotonic() - started))

    # -- engine thread -------------------------------------------------------------------

    def _admit(self, job: PrefillJob, sender) -> None:
        bs = self.engine.config.cache.block_size
        needed = -(-len(job.prompt_token_ids) // bs)
        if len(job.dst_block_ids) < needed:
            self.post(self._resolve, job.request_id, TandemError(
                f"destination has {len(job.dst_block_ids)} blocks, the prompt needs {needed}"))
            return
        try:
            self.engine.add_request(job.prompt_token_ids, job.params, job.request_id,
                                    stop_token_ids=frozenset(), max_tokens=1,
                                    max_chunk_tokens=job.max_chunk_tokens)
        except (TandemError, ValueError) as exc:
            self.post(self._resolve, job.request_id, exc)
            return
        self._transfers[job.request_id] = _Transfer(sender, list(job.dst_block_ids))

    def _layer_hook(self, plan: SchedulerOutput):
        """Which blocks each remote chunk of this pass sends, fixed before the pass runs."""
        bs = self.engine.config.cache.block_size
        sends = []
        for chunk in plan.chunks:
            transfer = self._transfers.get(chunk.request_id)
            if transfer is None:
                continue
            end = chunk.start_pos + chunk.num_tokens
            upto = -(-end // bs) if chunk.samples else end // bs
            if upto <= transfer.blocks_sent:
                continue
            src = self.engine.block_manager.block_table(chunk.request_id)[transfer.blocks_sent:upto]
            dst = transfer.dst_block_ids[transfer.blocks_sent:upto]
            transfer.blocks_sent = upto
            sends.append((chunk.request_id, transfer.sender, torch.tensor(src), dst))
        if not sends:
            return None
        kv = self.engine.runner.kv_cache

        def on_layer_done(layer: int) -> None:
            for request_id, sender, src, dst in sends:
                # Advanced indexing copies: the payload stays valid whatever the cache does next.
                sender.send(request_id, layer, dst, kv[layer, :, src])
        return on_layer_done

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            transfer = self._transfers.pop(out.request_id, None)
            if out.error:
                # The engine has freed the blocks already (payloads in flight are copies);
                # layers already handed to the sender still drain, as after an abort.
                if transfer is not None and transfer.blocks_sent:
                    self._draining[out.request_id] = transfer
                self.post(self._resolve, out.request_id, SamplingError(out.error))
                continue
            if transfer is not None:
                self._draining[out.request_id] = transfer
            if out.new_token_ids:
                self.post(self._resolve, out.request_id,
                          PrefillOutcome(out.new_token_ids[0], out.num_cached_tokens, 0.0))

    def poll(self) -> None:
        for request_id, transfer in list(self._draining.items()):
            status = transfer.sender.poll(request_id)
            if status.state.value != "in_flight":
                del self._draining[request_id]
                self.engine.block_manager.free(request_id)

    def _abort(self, request_id: str) -> None:
        # A request already draining has returned its token; its blocks go when the acks do.
        if request_id in self._draining:
            return
        transfer = self._transfers.pop(request_id, None)
        self.engine.abort_request(request_id, RequestStatus.FINISHED_ABORTED)
        if transfer is not None and transfer.blocks_sent:
            # Layers already handed to the sender: poll until it settles, so its bookkeeping
            # for this id ends. The blocks are already free (payloads are copies).
            self._draining[request_id] = transfer

    def on_fatal(self, exc: BaseException) -> None:
        def fail_all() -> None:
            for rid in list(self._futures):
                self._resolve(rid, RuntimeError(f"prefill engine failed: {exc}"))
        self.post(fail_all)
