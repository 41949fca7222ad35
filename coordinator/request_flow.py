"""Drives one request through the workers and yields its token ids as they arrive.

Remote prefill: two concurrent calls with one transfer id, no third leg (proto/worker.proto):

    coordinator                     decode worker                 prefill worker
    Generate(remote, T) ----------> reserve blocks (prefix cache first), grant them to T
    Prefill(T, decode's KV endpoint) ---------------------------> compute; the sender asks for
                                    <----- grant over kvtransfer --- T's grant, then streams
                                    <==== KV layer by layer ======   each layer as it is done
               <------------------------------------------------ PrefillResult(first token)
    yield first token (TTFT does not wait for the decode worker)
                                    <==== first token with the last layer's KV
               <----------------- events `tokens` ... finished

Local prefill (colocated worker, short prompt, or no prefill worker): Generate(remote_prefill=
false) alone; its `tokens` events start with the first token.

Failures and migration: a worker that dies (UNAVAILABLE, or a stream cut before it finished) is
marked dead, and the request is placed again (so is one on a worker the registry declares dead
for its silence: its calls are cancelled then), on the other workers, with the prompt plus the
tokens generated so far and what is left of max_tokens: the client's stream goes on where it
was, with the same text for greedy (and seeded) sampling. At most config.max_migrations times
per request; each attempt has its own transfer id. Any other failure (a worker's own error, a
deadline) ends the request with a WorkerError naming the worker. Every RPC has a deadline.

Cancellation: closing the generator (client disconnect, stop string) cancels the open calls;
each worker then aborts the request, and its blocks are freed once no transfer touches them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, replace

import grpc

from coordinator import convert
from coordinator.call_cancelled import cancelled_from_outside
from coordinator.config import CoordinatorConfig
from coordinator.placement import Placement, blocks_needed, place
from coordinator.registry import WorkerRecord, WorkerRegistry
from common import request_id, tracing
from common.errors import KV_TRANSFER_FAILED, TandemError
from common.logprobs import TokenLogprob
from common.rpc import worker_pb2 as pb
from common.sampling_params import SamplingParams
from common.wire import logprobs_from_proto

log = logging.getLogger(__name__)


class WorkerError(Exception):
    """A worker failed the request (a server fault, reported to the client as an error)."""


class TokenIds(list):
    """What the flow yields: a list of token ids (callers may treat it as one) that also carries
    `logprobs`, parallel to it when the request asked for them (SamplingParams.logprobs), else
    empty, and, with the first token of a request that asked for SamplingParams.prompt_logprobs,
    `prompt_logprobs`: the prompt tokens' after the first (else empty)."""

    def __init__(self, ids, logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        super().__init__(ids)
        self.logprobs: list[TokenLogprob] = list(logprobs or ())
        self.prompt_logprobs: list[TokenLogprob] = list(prompt_logprobs or ())


class NoWorkers(TandemError):
    """No live worker can take the request now (HTTP 503)."""


@dataclass(frozen=True)
class FlowRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # tokens the request may generate (num_predict and the context applied)
    stop_token_ids: frozenset[int]
    # The prefix-cache tenant (common/block_hash.py, coordinator/tenants.py): b"" = shared.
    cache_salt: bytes = b""
    # The id the client's logs know the request by (common/request_id.py: its X-Request-Id
    # or one made for it), sent to the workers as gRPC metadata so their log lines carry it.
    # Not request_id: that one names KV transfers and is unique; two clients may send one id.
    log_id: str = ""
    # The choices of one OpenAI request (n > 1, coordinator/choices.py) share one: the first
    # to be placed names its decode worker, and the others go there too while it lives, so
    # they find the prompt's KV in its prefix cache.
    siblings: Siblings | None = None


@dataclass
class Siblings:
    decode_worker: str = ""  # "" until the first of them is placed


@dataclass
class FlowOutcome:
    """Filled in while the flow runs; complete once its generator is exhausted."""

    finish_reason: str | None = None  # "stop" | "length"; None until the request finished
    decode_worker: str = ""
    prefill_worker: str = ""  # "" for a local prefill
    placement_reason: str = ""
    cached_tokens: int = 0
    prefill_seconds: float = 0.0  # on the prefill worker, as it reported
    kv_bytes: int = 0  # KV bytes moved to the decode worker (its uncached blocks)
    migrations: int = 0  # times the request moved to another worker after one died


class _WorkerDied(Exception):
    """A worker went away mid-request (the request may move elsewhere)."""

    def __init__(self, worker_id: str, message: str) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class RequestFlow:
    def __init__(self, registry: WorkerRegistry, config: CoordinatorConfig) -> None:
        self.registry = registry
        self.config = config

    def place(self, prompt_ids: list[int], exclude: Collection[str] = (),
              cache_salt: bytes = b"", prefer_decode: str = "", scored: bool = False) -> Placement:
        """prefer_decode: the decode-capable worker to use when it is live and not excluded
        (a sibling choice's); the prefill worker is still chosen as for any request. scored:
        the request wants its prompt's logprobs (placement.place)."""
        workers = [w for w in self.registry.snapshots() if w.worker_id not in exclude]
        if prefer_decode and any(w.worker_id == prefer_decode for w in workers):
            workers = [w for w in workers if w.role == "prefill" or w.worker_id == prefer_decode]
        placement = place(workers, prompt_ids,
                          prefill_threshold=self.config.prefill_threshold,
                          default_budget=self.config.chunk_size, cache_salt=cache_salt,
                          scored=scored, max_stall_s=self.config.local_prefill_max_stall_s)
        if placement is None:
            raise NoWorkers("no live decode worker is registered; retry once workers are up")
        return placement

    async def stream(self, req: FlowRequest, out: FlowOutcome) -> AsyncIterator[TokenIds]:
        generated: list[int] = []
        dead: list[str] = []
        while True:
            attempt = out.migrations
            transfer_id = req.request_id if attempt == 0 else f"{req.request_id}~{attempt}"
            try:
                async for token_ids in self._attempt(req, transfer_id, req.prompt_ids + generated,
                                                     len(generated), out, dead):
                    generated.extend(token_ids)
                    yield token_ids
                return
            except _WorkerDied as exc:
                if out.migrations >= self.config.max_migrations:
                    raise WorkerError(f"{exc} (request moved {out.migrations} times already)") from None
                dead.append(exc.worker_id)
                try:
                    self.place(req.prompt_ids + generated, dead)
                except NoWorkers:
                    raise WorkerError(f"{exc}; no live worker left to move the request to") from None
                out.migrations += 1
                log.warning("request %s: %s; placing it again with %d generated tokens (move %d)",
                            req.request_id, exc, len(generated), out.migrations)

    # ---- one placement ----------------------------------------------------------------------

    async def _attempt(self, req: FlowRequest, transfer_id: str, prompt_ids: list[int],
                       prior: int, out: FlowOutcome,
                       dead: Collection[str]) -> AsyncIterator[TokenIds]:
        """One placement. `prior`: trailing tokens of prompt_ids that earlier placements
        generated (0 on the first), counted against max_tokens and shown to the grammar."""
        max_tokens = req.max_tokens - prior
        # After a move the prompt logprobs have come already (with the first token).
        params = (replace(req.params, prompt_logprobs=None) if prior else req.params)
        siblings = req.siblings
        placing_ns = time.time_ns()
        placement = self.place(prompt_ids, dead, req.cache_salt,
                               siblings.decode_worker if siblings is not None else "",
                               scored=params.prompt_logprobs is not None)
        # A sibling of flow.attempt under the request's span (this generator's context).
        tracing.span_between("placement", None, placing_ns, time.time_ns(), {
            "tandem.placement": placement.reason, "tandem.excluded_workers": len(dead)})
        if siblings is not None and not siblings.decode_worker:
            siblings.decode_worker = placement.decode.worker_id
        decode = self.registry.get(placement.decode.worker_id)
        remote = placement.prefill is not None
        out.decode_worker, out.placement_reason = decode.worker_id, placement.reason
        local_tokens = 0 if remote else len(prompt_ids)
        # The workers' spans are children of this one (traceparent in both calls' metadata).
        span = tracing.start_span("flow.attempt", attributes={
            "tandem.decode_worker": decode.worker_id,
            "tandem.prefill_worker": placement.prefill.worker_id if remote else "",
            "tandem.placement": placement.reason, "tandem.prompt_tokens": len(prompt_ids),
            "tandem.transfer_id": transfer_id})
        metadata = request_id.metadata(req.log_id) + tracing.metadata(span)
        self.registry.assign(decode, requests=1, prefill_tokens=local_tokens)
        call = decode.decode_stub.Generate(
            convert.generate_request(transfer_id, prompt_ids, params, req.stop_token_ids,
                                     max_tokens, remote,
                                     0 if remote else self.config.local_chunk_size,
                                     transfer_id=transfer_id if remote else "",
                                     num_prior_output_tokens=prior, cache_salt=req.cache_salt),
            timeout=self.config.request_timeout_s, metadata=metadata)
        read = asyncio.ensure_future(self._read(call, decode, self.config.token_timeout_s))
        decoded = 0  # tokens the decode worker produced
        # What the decode worker's statuses saw of this request, for placement (which reads
        # its used blocks less what ended since a status: registry.release): statuses are
        # counted from its first event (it holds the request's KV by then); `counted` is the
        # tokens it had decoded when the latest of those came, `seen` that status's number.
        seen, counted = None, 0
        try:
            if remote:
                first = await self._remote_prefill(read, decode, placement.prefill.worker_id,
                                                   transfer_id, prompt_ids, prior, params, out,
                                                   req.cache_salt,
                                                   stop_token_ids=req.stop_token_ids,
                                                   metadata=metadata)
                ends = self._ends_at(first[0], req.stop_token_ids, max_tokens)
                yield first
                if ends:
                    out.finish_reason = ends
                    return
            async for token_ids in self._tokens(read, call, decode, out, remote):
                if local_tokens:  # the local prefill is done once tokens flow
                    self.registry.assign(decode, prefill_tokens=-local_tokens)
                    local_tokens = 0
                if seen is None:
                    seen = decode.statuses
                elif decode.statuses != seen:
                    seen, counted = decode.statuses, decoded
                decoded += len(token_ids)
                yield token_ids
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            span.set_attribute("tandem.finish_reason", out.finish_reason or "")
            span.end()
            read.cancel()
            call.cancel()  # a no-op once the stream has ended
            self.registry.assign(decode, requests=-1, prefill_tokens=-local_tokens)
            # Its blocks are free there now (the worker frees them as the stream ends), but a
            # status that counted it, with none since its last token, says otherwise until the
            # worker's next one. Not the prompt's blocks the worker had cached: others may
            # hold them still.
            if counted and decode.statuses == seen:
                self.registry.release(decode, max(0, blocks_needed(
                    len(prompt_ids) + (1 if remote else 0) + counted, decode.load.block_size)
                    - placement.overlap_blocks))

    async def _remote_prefill(self, read: asyncio.Future, decode: WorkerRecord, prefill_id: str,
                              transfer_id: str, prompt_ids: list[int], prior: int,
                              params: SamplingParams, out: FlowOutcome,
                              cache_salt: bytes = b"",
                              stop_token_ids: frozenset[int] = frozenset(),
                              metadata: tuple[tuple[str, str], ...] = ()) -> TokenIds:
        """The first token (and its logprob) from the prefill worker, while watching the decode
        stream: a decode worker that fails or dies meanwhile ends the wait at once."""
        record = self.registry.get(prefill_id)
        n = len(prompt_ids)
        self.registry.assign(record, prefill_tokens=n)
        call = record.prefill_stub.Prefill(
            convert.prefill_request(transfer_id, prompt_ids, params, decode.kv_endpoint,
                                    decode.kv_backend, self.config.chunk_size, prior, cache_salt,
                                    stop_token_ids),
            timeout=self.config.prefill_timeout_s, metadata=metadata)
        prefill = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({prefill, read}, return_when=asyncio.FIRST_COMPLETED)
            if read in done:
                # The decode stream spoke before the first token: a failure or a worker gone
                # ends the wait (an early token, unlikely, is kept for _tokens).
                self._check_early(read, decode, prefill_id)
                await asyncio.wait({prefill})
            try:
                result = prefill.result()
            except asyncio.CancelledError:  # the call's channel retired under it (see _read)
                if cancelled_from_outside():
                    raise
                raise _WorkerDied(prefill_id, f"prefill worker {prefill_id}'s call was "
                                  "cancelled (declared dead, or it registered again)") from None
            except grpc.aio.AioRpcError as exc:
                message = _rpc_message("prefill", record, exc)
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_dead(prefill_id, f"Prefill failed: {exc.details()}")
                    raise _WorkerDied(prefill_id, message) from None
                raise WorkerError(message) from None
        finally:
            prefill.cancel()
            call.cancel()  # reached early only on failure or cancellation: abort the prefill
            self.registry.assign(record, prefill_tokens=-n)
        out.prefill_worker = prefill_id
        out.cached_tokens = result.num_cached_tokens
        out.prefill_seconds = result.prefill_seconds
        return TokenIds([result.first_token], logprobs_from_proto(result.logprobs),
                        logprobs_from_proto(result.prompt_logprobs))

    def _check_early(self, read: asyncio.Future, decode: WorkerRecord, prefill_id: str) -> None:
        """An event the decode worker sent before the first token: raises for a failure."""
        if not read.done():
            return
        event = read.result()  # raises what _read raised (worker gone, deadline)
        if event is None:
            raise _WorkerDied(decode.worker_id, f"decode worker {decode.worker_id} closed the "
                              "stream before the request finished")
        tokens = event.tokens
        if tokens.finished and tokens.finish_reason in ("error", "abort"):
            _raise_failure(decode, tokens, prefill_id)

    async def _tokens(self, read: asyncio.Future, call, decode: WorkerRecord, out: FlowOutcome,
                      remote: bool) -> AsyncIterator[TokenIds]:
        """`read` is the pending read of the stream's first event."""
        event = await read
        first = True
        while True:
            if event is None:
                raise _WorkerDied(decode.worker_id, f"decode worker {decode.worker_id} closed "
                                  "the stream before the request finished")
            if not event.HasField("tokens"):
                raise WorkerError(f"decode worker {decode.worker_id} sent an unexpected "
                                  f"{event.WhichOneof('event')!r} event")
            tokens = event.tokens
            if first:
                first = False
                out.kv_bytes += tokens.kv_bytes_received
                if not remote and tokens.num_cached_tokens:
                    out.cached_tokens = tokens.num_cached_tokens
            if tokens.finished and tokens.finish_reason in ("error", "abort"):
                _raise_failure(decode, tokens, out.prefill_worker if remote else "")
            if tokens.token_ids:
                yield TokenIds(tokens.token_ids, logprobs_from_proto(tokens.logprobs),
                               logprobs_from_proto(tokens.prompt_logprobs))
            if tokens.finished:
                out.finish_reason = tokens.finish_reason or "stop"
                return
            event = await self._read(call, decode, self.config.token_timeout_s)

    async def _read(self, call, decode: WorkerRecord, timeout: float) -> pb.GenerateEvent | None:
        """The next Generate event; None at the end of the stream."""
        try:
            event = await asyncio.wait_for(call.read(), timeout)
        except asyncio.TimeoutError:
            raise WorkerError(f"decode worker {decode.worker_id} sent nothing for "
                              f"{timeout:g} s") from None
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            # Not our task's cancellation: the call's channel was closed under it (the worker
            # was declared dead for its silence, or registered again and its old channel was
            # retired). A worker failure: move on.
            raise _WorkerDied(decode.worker_id, f"decode worker {decode.worker_id}'s call was "
                              "cancelled (declared dead, or it registered again)") from None
        except grpc.aio.AioRpcError as exc:
            message = _rpc_message("decode", decode, exc)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_dead(decode.worker_id, f"Generate failed: {exc.details()}")
                raise _WorkerDied(decode.worker_id, message) from None
            raise WorkerError(message) from None
        return None if event is grpc.aio.EOF else event

    @staticmethod
    def _ends_at(first: int, stop_token_ids: frozenset[int], max_tokens: int) -> str | None:
        if first in stop_token_ids:
            return "stop"
        if max_tokens <= 1:
            return "length"
        return None


def _raise_failure(decode: WorkerRecord, tokens: pb.Tokens, prefill_id: str) -> None:
    """A decode worker's error event. A failed KV transfer from a prefill worker (its process
    died mid-transfer, the link was cut, a frame was refused) leaves the decode worker sound:
    the request moves, like one whose worker died, to a placement without that prefill worker
    (for this request only: it may be alive)."""
    detail = tokens.error or f"finish_reason {tokens.finish_reason!r}"
    message = f"decode worker {decode.worker_id} failed the request: {detail}"
    if prefill_id and tokens.error.startswith(KV_TRANSFER_FAILED):
        raise _WorkerDied(prefill_id, message)
    raise WorkerError(message)


def _rpc_message(role: str, record: WorkerRecord | None, exc: grpc.aio.AioRpcError) -> str:
    where = f"{record.worker_id} at {record.address}" if record is not None else "?"
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{role} worker {where} did not answer before its deadline"
    return f"{role} worker {where} failed: {code.name}: {exc.details()}"
