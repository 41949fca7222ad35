"""The prefill worker's gRPC face (PrefillWorker in proto/worker.proto). Prefill returns the
first token as soon as it is sampled; the KV keeps streaming to the decode worker. A cancelled
call aborts the request and frees its blocks."""

from __future__ import annotations

import logging
import time

import grpc

from common import request_id, tracing
from worker import trace_spans

from common.errors import ResidencyError, TandemError
from worker.node_server import embed_rpc, set_resident
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from common.wire import logprobs_to_proto, sampling_from_proto
from prefill_node.senders import SenderPool
from prefill_node.worker import PrefillJob, PrefillWorker

log = logging.getLogger("tandem.prefill")


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker, senders: SenderPool, status) -> None:
        self.worker = worker
        self.senders = senders
        self.status_fn = status

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResult:
        # The client's request id, on this call's log lines (grpc.aio: one task per call).
        metadata = context.invocation_metadata()
        request_id.current.set(request_id.from_metadata(metadata))
        # A child of the coordinator's span (traceparent in the metadata; common/tracing.py).
        with tracing.current_span("prefill", parent=tracing.extract(metadata), kind="server",
                                  attributes={"tandem.transfer_id": request.transfer_id,
                                              "tandem.prompt_tokens":
                                                  len(request.prompt_token_ids)}) as span:
            # Traces on: the engine records this request's passes, made into spans once the
            # first token is out (worker/trace_spans.py); the transfer's own come at its end.
            passes = [] if span.is_recording() else None
            arrived_ns = time.time_ns()
            try:
                result = await self._prefill(request, context, passes, span if passes is not None else None)
            finally:
                if passes is not None:
                    done = list(passes)
                    trace_spans.queue_span("prefill.queue", span, arrived_ns, done)
                    trace_spans.chunk_spans(span, done)
            span.set_attribute("tandem.cached_tokens", result.num_cached_tokens)
            return result

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext,
                       passes: list | None = None, span=None) -> pb.PrefillResult:
        dest = request.destination
        if not request.request_id or not request.prompt_token_ids or not dest.endpoint:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id, prompt_token_ids and destination.endpoint are required")
        try:
            params = sampling_from_proto(request.sampling)
            sender = await self.senders.get(dest.backend, dest.endpoint)
        except TandemError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        job = PrefillJob(request.request_id, list(request.prompt_token_ids), params,
                         request.transfer_id or request.request_id, request.max_chunk_tokens,
                         request.num_prior_output_tokens, request.cache_salt,
                         frozenset(request.stop_token_ids), request_id.current.get(), passes,
                         span)
        try:
            outcome = await self.worker.prefill(job, sender)
        except ResidencyError as exc:  # unloaded: the coordinator loads before dispatching
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (TandemError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:  # the engine loop died: the coordinator retries elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("prefill %s: %d prompt tokens (%d cached) in %.3f s, KV to %s (%s)",
                 job.transfer_id, len(job.prompt_token_ids), outcome.num_cached_tokens,
                 outcome.seconds, dest.endpoint, dest.backend)
        return pb.PrefillResult(first_token=outcome.first_token, num_cached_tokens=outcome.num_cached_tokens,
                                prefill_seconds=outcome.seconds,
                                logprobs=logprobs_to_proto(outcome.logprobs),
                                prompt_logprobs=logprobs_to_proto(outcome.prompt_logprobs))

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResult:
        return await embed_rpc(self.worker, request, context)

    async def Status(self, request, context) -> pb.WorkerStatus:
        return self.status_fn()

    async def SetResident(self, request: pb.ResidencyRequest, context) -> pb.ResidencyResult:
        return await set_resident(self.worker, request, context)
