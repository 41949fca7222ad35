"""The decode worker's gRPC face (DecodeWorker in proto/worker.proto): translates RPCs into
DecodeWorker calls and events back into messages. Cancelling a Generate call (client gone,
stop string, coordinator gives up) aborts the request and frees its blocks."""

from __future__ import annotations

import logging
import time

import grpc

from common import request_id, tracing
from worker import trace_spans

from decode_node.worker import DecodeJob, DecodeWorker
from common.errors import ResidencyError, TandemError
from worker.node_server import embed_rpc, set_resident
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from common.wire import logprobs_to_proto, sampling_from_proto

log = logging.getLogger("tandem.decode")


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker, status) -> None:
        self.worker = worker
        self.status_fn = status

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        # The client's request id, on this call's log lines (grpc.aio: one task per call).
        metadata = context.invocation_metadata()
        request_id.current.set(request_id.from_metadata(metadata))
        # Not the current span: this generator's body spans its yields (common/tracing.py).
        span = tracing.start_span("decode", parent=tracing.extract(metadata), kind="server",
                                  attributes={"tandem.request_id": request.request_id,
                                              "tandem.prompt_tokens": len(request.prompt_token_ids),
                                              "tandem.remote_prefill": request.remote_prefill})
        messages = self._generate(request, context, span)
        try:
            async for message in messages:
                yield message
        finally:
            await messages.aclose()  # now, not at garbage collection: its finally frees the KV
            span.end()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        span):
        try:
            params = sampling_from_proto(request.sampling)
        except TandemError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not request.request_id or not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and prompt_token_ids are required")
        # Traces on: the engine records this request's passes, made into spans at its end
        # (worker/trace_spans.py).
        passes = [] if span.is_recording() else None
        arrived_ns = time.time_ns()
        job = DecodeJob(request.request_id, list(request.prompt_token_ids), params,
                        frozenset(request.stop_token_ids), request.max_tokens or 1 << 30,
                        request.remote_prefill, request.max_chunk_tokens, request.transfer_id,
                        request.num_prior_output_tokens, request.cache_salt,
                        request_id.current.get(), passes)
        try:
            events = self.worker.open(job)
        except ResidencyError as exc:  # unloaded: the coordinator loads before dispatching
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except RuntimeError as exc:  # the engine loop died: let the coordinator route around us
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("generate %s: %d prompt tokens, %s prefill, up to %d tokens", job.request_id,
                 len(job.prompt_token_ids), "remote" if job.remote_prefill else "local",
                 job.max_tokens)
        finished = False
        generated = 0
        # A remote prefill's first tokens event waits for every layer of its KV.
        transfer = (tracing.start_span("kv_transfer", parent=span,
                                       attributes={"tandem.transfer_id": job.transfer_id})
                    if job.remote_prefill else None)
        try:
            while not finished:
                event = await events.get()
                finished = event.finished
                generated += len(event.token_ids)
                if transfer is not None:
                    transfer.set_attribute("tandem.kv_bytes", event.kv_bytes_received)
                    transfer.end()
                    transfer = None
                if finished:
                    log.info("generate %s: %s after %d tokens%s", job.request_id,
                             event.finish_reason or "finished", generated,
                             f" ({event.error})" if event.error else "")
                yield pb.GenerateEvent(tokens=pb.Tokens(
                    token_ids=event.token_ids, finished=event.finished, finish_reason=event.finish_reason,
                    error=event.error, num_cached_tokens=event.num_cached_tokens,
                    kv_bytes_received=event.kv_bytes_received,
                    logprobs=logprobs_to_proto(event.logprobs),
                    prompt_logprobs=logprobs_to_proto(event.prompt_logprobs)))
        finally:
            span.set_attribute("tandem.output_tokens", generated)
            if transfer is not None:
                transfer.end()
            if passes is not None:
                done = list(passes)
                if not job.remote_prefill:
                    trace_spans.queue_span("decode.queue", span, arrived_ns, done)
                    trace_spans.chunk_spans(span, done)
                trace_spans.decode_steps_span(span, done)
            if not finished:
                log.info("generate %s: cancelled by the coordinator after %d tokens",
                         job.request_id, generated)
                self.worker.close_stream(job.request_id)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResult:
        return await embed_rpc(self.worker, request, context)

    async def Status(self, request, context) -> pb.WorkerStatus:
        return self.status_fn()

    async def SetResident(self, request: pb.ResidencyRequest, context) -> pb.ResidencyResult:
        return await set_resident(self.worker, request, context)

