"""Drives one request through the workers and yields its token ids as they arrive.

Remote prefill (the 3-step flow of proto/worker.proto):

    coordinator                     decode worker                 prefill worker
    Generate(remote_prefill) -----> reserve blocks
               <----------------- event `reserved` (block ids, KV endpoint, backend)
    Prefill(destination) ---------------------------------------> compute, stream KV layers
                                    <==== KV over kvtransfer ====
               <------------------------------------------------ PrefillResult(first token)
    yield first token (TTFT does not wait for the decode worker)
    StartDecode(first token) -----> join the batch once all KV arrived
               <----------------- events `tokens` ... finished

Local prefill (colocated worker, short prompt, or no prefill worker): Generate(remote_prefill=
false) alone; its `tokens` events start with the first token.

Failures: a Prefill failing UNAVAILABLE (worker gone) is retried once on another compatible
prefill worker, into the same reserved blocks; any other Prefill failure, or no worker left,
sends StartDecode(error) so the decode worker frees the reservation, and ends the request with
a WorkerError. A failing Generate stream ends the request with a WorkerError naming the worker;
UNAVAILABLE also marks the worker dead in the registry. Every RPC has a deadline.

Cancellation: closing the generator (client disconnect, stop string) cancels the open calls;
cancelling the Generate stream aborts the request and frees its blocks on the decode worker.
If the first token already ends the request (a stop token, or max_tokens == 1), the Generate
stream is cancelled instead of sending StartDecode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from coordinator import convert
from coordinator.config import CoordinatorConfig
from coordinator.placement import Placement, choose_prefill, place
from coordinator.registry import WorkerRecord, WorkerRegistry
from engine.errors import TandemError
from engine.rpc import worker_pb2 as pb
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """A worker failed the request (a server fault, reported to the client as an error)."""


class NoWorkers(TandemError):
    """No live worker can take the request now (HTTP 503)."""


@dataclass(frozen=True)
class FlowRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # tokens the request may generate (num_predict and the context applied)
    stop_token_ids: frozenset[int]


@dataclass
class FlowOutcome:
    """Filled in while the flow runs; complete once its generator is exhausted."""

    finish_reason: str | None = None  # "stop" | "length"; None until the request finished
    decode_worker: str = ""
    prefill_worker: str = ""  # "" for a local prefill
    placement_reason: str = ""
    cached_tokens: int = 0
    prefill_seconds: float = 0.0  # on the prefill worker, as it reported


class RequestFlow:
    def __init__(self, registry: WorkerRegistry, config: CoordinatorConfig) -> None:
        self.registry = registry
        self.config = config

    def place(self, prompt_tokens: int) -> Placement:
        placement = place(self.registry.snapshots(), prompt_tokens,
                          prefill_threshold=self.config.prefill_threshold,
                          default_budget=self.config.chunk_size)
        if placement is None:
            raise NoWorkers("no live decode worker is registered; retry once workers are up")
        return placement

    async def stream(self, req: FlowRequest, out: FlowOutcome) -> AsyncIterator[list[int]]:
        placement = self.place(len(req.prompt_ids))
        decode = self.registry.get(placement.decode.worker_id)
        remote = placement.prefill is not None
        out.decode_worker, out.placement_reason = decode.worker_id, placement.reason
        local_tokens = 0 if remote else len(req.prompt_ids)
        self.registry.assign(decode.worker_id, requests=1, prefill_tokens=local_tokens)
        call = decode.decode_stub.Generate(
            convert.generate_request(req.request_id, req.prompt_ids, req.params,
                                     req.stop_token_ids, req.max_tokens, remote,
                                     0 if remote else self.config.local_chunk_size),
            timeout=self.config.request_timeout_s)
        try:
            if remote:
                first = await self._remote_prefill(call, decode, placement, req, out)
                ends = self._ends_at(first, req)
                if ends:
                    out.finish_reason = ends
                    yield [first]
                    return
                start = asyncio.ensure_future(self._start_decode(decode, req.request_id, first))
                try:
                    yield [first]
                    await start
                finally:
                    start.cancel()
            async for token_ids in self._tokens(call, decode, out, remote):
                if local_tokens:  # the local prefill is done once tokens flow
                    self.registry.assign(decode.worker_id, prefill_tokens=-local_tokens)
                    local_tokens = 0
                yield token_ids
        finally:
            call.cancel()  # a no-op once the stream has ended
            self.registry.assign(decode.worker_id, requests=-1, prefill_tokens=-local_tokens)

    # ---- steps ----------------------------------------------------------------------------------

    async def _remote_prefill(self, call, decode: WorkerRecord, placement: Placement,
                              req: FlowRequest, out: FlowOutcome) -> int:
        event = await self._read(call, decode, self.config.reserve_timeout_s)
        if event is None or not event.HasField("reserved"):
            detail = event.tokens.error if event is not None and event.tokens.error else ""
            raise WorkerError(f"decode worker {decode.worker_id} did not reserve KV blocks"
                              + (f": {detail}" if detail else ""))
        reserved = event.reserved
        tried: list[str] = []
        prefill_id = placement.prefill.worker_id
        while True:
            tried.append(prefill_id)
            try:
                result = await self._prefill(prefill_id, req, reserved)
                break
            except grpc.aio.AioRpcError as exc:
                message = _rpc_message("prefill", self.registry.get(prefill_id), exc)
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_dead(prefill_id, f"Prefill failed: {exc.details()}")
                    retry = choose_prefill(self.registry.snapshots(("prefill",)),
                                           placement.decode, exclude=tried)
                    if retry is not None and len(tried) == 1:
                        log.warning("request %s: %s; retrying on prefill worker %s",
                                    req.request_id, message, retry.worker_id)
                        prefill_id = retry.worker_id
                        continue
            await self._abort_decode(decode, req.request_id, message)
            raise WorkerError(message)
        out.prefill_worker = prefill_id
        out.cached_tokens = result.num_cached_tokens
        out.prefill_seconds = result.prefill_seconds
        return result.first_token

    async def _prefill(self, worker_id: str, req: FlowRequest,
                       reserved: pb.Reserved) -> pb.PrefillResult:
        record = self.registry.get(worker_id)
        n = len(req.prompt_ids)
        self.registry.assign(worker_id, prefill_tokens=n)
        call = record.prefill_stub.Prefill(
            convert.prefill_request(req.request_id, req.prompt_ids, req.params, reserved,
                                    self.config.chunk_size),
            timeout=self.config.prefill_timeout_s)
        try:
            return await call
        finally:
            call.cancel()  # reached early only on cancellation: abort the prefill
            self.registry.assign(worker_id, prefill_tokens=-n)

    async def _start_decode(self, decode: WorkerRecord, request_id: str, first: int) -> None:
        try:
            await decode.decode_stub.StartDecode(
                pb.StartDecodeRequest(request_id=request_id, first_token=first),
                timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._decode_failed(decode, exc)

    async def _abort_decode(self, decode: WorkerRecord, request_id: str, error: str) -> None:
        """Best effort: the Generate stream is cancelled right after, which frees the blocks too."""
        try:
            await decode.decode_stub.StartDecode(
                pb.StartDecodeRequest(request_id=request_id, error=error),
                timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("request %s: StartDecode(error) to %s failed: %s", request_id,
                        decode.worker_id, exc.code().name)

    async def _tokens(self, call, decode: WorkerRecord, out: FlowOutcome,
                      remote: bool) -> AsyncIterator[list[int]]:
        while True:
            event = await self._read(call, decode, self.config.token_timeout_s)
            if event is None:
                raise WorkerError(f"decode worker {decode.worker_id} closed the stream before "
                                  "the request finished")
            if not event.HasField("tokens"):
                raise WorkerError(f"decode worker {decode.worker_id} sent an unexpected "
                                  f"{event.WhichOneof('event')!r} event")
            tokens = event.tokens
            if tokens.num_cached_tokens and not remote:
                out.cached_tokens = tokens.num_cached_tokens
            if tokens.finished and tokens.finish_reason in ("error", "abort"):
                detail = tokens.error or f"finish_reason {tokens.finish_reason!r}"
                raise WorkerError(f"decode worker {decode.worker_id} failed the request: {detail}")
            if tokens.token_ids:
                yield list(tokens.token_ids)
            if tokens.finished:
                out.finish_reason = tokens.finish_reason or "stop"
                return

    async def _read(self, call, decode: WorkerRecord, timeout: float) -> pb.GenerateEvent | None:
        """The next Generate event; None at the end of the stream."""
        try:
            event = await asyncio.wait_for(call.read(), timeout)
        except asyncio.TimeoutError:
            raise WorkerError(f"decode worker {decode.worker_id} sent nothing for "
                              f"{timeout:g} s") from None
        except grpc.aio.AioRpcError as exc:
            self._decode_failed(decode, exc)
        return None if event is grpc.aio.EOF else event

    def _decode_failed(self, decode: WorkerRecord, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.registry.mark_dead(decode.worker_id, f"Generate failed: {exc.details()}")
        raise WorkerError(_rpc_message("decode", decode, exc)) from None

    @staticmethod
    def _ends_at(first: int, req: FlowRequest) -> str | None:
        if first in req.stop_token_ids:
            return "stop"
        if req.max_tokens <= 1:
            return "length"
        return None


def _rpc_message(role: str, record: WorkerRecord | None, exc: grpc.aio.AioRpcError) -> str:
    where = f"{record.worker_id} at {record.address}" if record is not None else "?"
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{role} worker {where} did not answer before its deadline"
    return f"{role} worker {where} failed: {code.name}: {exc.details()}"
