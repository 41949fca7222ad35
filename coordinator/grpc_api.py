"""The client-facing gRPC API (proto/tandem.proto, service tandem.v1.Tandem), with the standard
grpc.health.v1 service and server reflection, on its own port beside the HTTP APIs.

Generate and Chat share everything below the parse with the HTTP routes: prompts.py renders
and tokenizes, Coordinator.submit checks limits and admits, Generation streams text. Errors
before the first response abort the call with a status code (the table in tandem.proto); a
worker failing mid-stream aborts it with INTERNAL. A client that cancels the call closes the
response generator, whose `finally` closes the Generation: every worker's stream is cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator import model_info
from coordinator.access import ApiKeyInterceptor, grpc_salt
from coordinator.admission import Overloaded
from coordinator.generation import Generation
from coordinator.metrics import RequestTimings
from coordinator.ollama_request import check_messages
from coordinator.model import shown
from coordinator.prompts import chat_prompt_ids, generate_prompt_ids, off_loop
from coordinator.request_flow import NoWorkers, WorkerError
from coordinator.response_cache import last_user_text
from common import request_id
from common.rpc import tandem_pb2 as pb
from common.rpc import tandem_pb2_grpc as pb_grpc
from coordinator.service import Coordinator
from common.errors import ModelNotFoundError, TandemError
from common.model_defaults import ModelDefaults
from common.sampling_params import SamplingParams
from common.grpc_server import bind, new_server

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name
_SCALARS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
            "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "num_predict",
            "num_ctx", "num_keep", "num_batch", "num_thread", "cache")


def options_to_params(options: pb.Options, defaults: ModelDefaults = ModelDefaults()
                      ) -> SamplingParams:
    """The request's options over the model's defaults (common/model_defaults.py)."""
    values = {name: getattr(options, name) for name in _SCALARS if options.HasField(name)}
    if options.stop:
        values["stop"] = list(options.stop)
    return SamplingParams.from_options(defaults.options_under(values))


def _status(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NoWorkers):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, TandemError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def _figures(g: Generation) -> pb.Figures:
    t = g.timings
    t.finish()
    ns = lambda s: max(0, round((s or 0.0) * 1e9))  # noqa: E731
    return pb.Figures(
        total_duration=ns(t.e2e), load_duration=0, prompt_eval_count=t.prompt_tokens,
        prompt_eval_duration=ns(t.ttft if t.ttft is not None else t.e2e),
        eval_count=t.output_tokens, eval_duration=ns(t.eval_time),
        cached_tokens=g.outcome.cached_tokens, decode_worker=g.outcome.decode_worker,
        prefill_worker=g.outcome.prefill_worker, cache=g.cache or "")


async def _serve_request_id(context: grpc.aio.ServicerContext) -> None:
    """The caller's `x-request-id` metadata (or a new id) on this call's log lines, the workers'
    calls (Coordinator.prepare) and the call's initial metadata, as X-Request-Id over HTTP.
    grpc.aio serves each call in its own task, so the context variable is this call's alone."""
    rid = request_id.accept(request_id.from_metadata(context.invocation_metadata()))
    request_id.current.set(rid)
    await context.send_initial_metadata(request_id.metadata(rid))


class TandemServicer(pb_grpc.TandemServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        # Each model's description, made once (a model loaded on request: when first listed).
        self._infos = {m.fingerprint: model_info.describe(m) for m in coordinator.models}
        self.keys = coordinator.config.api_keys()  # tenants, for the prefix cache's salt

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        if _status(exc) == grpc.StatusCode.INTERNAL and not isinstance(exc, WorkerError):
            log.exception("internal error")
        await context.abort(_status(exc), shown(str(exc), 1000))  # echoes at most 1000 chars

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await _serve_request_id(context)
        timings = RequestTimings()
        try:
            model = await self.coordinator.find_model(request.model)
            name = model.name
            params = options_to_params(request.options, model.defaults)
            if not request.prompt and not request.context:
                yield pb.GenerateResponse(model=name, done=True, done_reason="load")
                return
            prompt_ids = await off_loop(generate_prompt_ids, model, request.prompt,
                                        request.system or model.defaults.system, request.raw,
                                        list(request.context),
                                        params.context_limit(model.context_len))
            generation = await self.coordinator.submit(
                prompt_ids, params, timings, cache_salt=grpc_salt(self.keys, context),
                model=model, turn=request.prompt or None)
        except Exception as exc:  # noqa: BLE001 (every failure becomes a status code)
            await self._abort(context, exc)
            return
        try:
            async for piece in generation.pieces():
                yield pb.GenerateResponse(model=name, response=piece)
            ctx = [] if request.raw else prompt_ids + generation.output_ids
            yield pb.GenerateResponse(model=name, done=True,
                                      done_reason=generation.done_reason or "stop",
                                      figures=_figures(generation), context=ctx)
        except WorkerError as exc:
            await self._abort(context, exc)
        finally:
            await generation.close()

    async def Chat(self, request: pb.ChatRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatResponse]:
        await _serve_request_id(context)
        timings = RequestTimings()
        try:
            model = await self.coordinator.find_model(request.model)
            params = options_to_params(request.options, model.defaults)
            messages = model.defaults.with_system(check_messages(
                [{"role": m.role, "content": m.content} for m in request.messages],
                self.coordinator.config.max_messages))
            if not messages:
                yield pb.ChatResponse(model=model.name, done=True, done_reason="load",
                                      message=pb.Message(role="assistant"))
                return
            prompt_ids = await off_loop(chat_prompt_ids, model, messages, None,
                                        params.context_limit(model.context_len))
            generation = await self.coordinator.submit(
                prompt_ids, params, timings, cache_salt=grpc_salt(self.keys, context),
                model=model, turn=last_user_text(messages))
        except Exception as exc:  # noqa: BLE001 (every failure becomes a status code)
            await self._abort(context, exc)
            return
        try:
            async for piece in generation.pieces():
                yield pb.ChatResponse(model=model.name,
                                      message=pb.Message(role="assistant", content=piece))
            yield pb.ChatResponse(model=model.name, message=pb.Message(role="assistant"),
                                  done=True, done_reason=generation.done_reason or "stop",
                                  figures=_figures(generation))
        except WorkerError as exc:
            await self._abort(context, exc)
        finally:
            await generation.close()

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(
            name=i.name, size=i.size, digest=i.digest, format=i.format, family=i.family,
            parameter_size=i.parameter_size, quantization_level=i.quantization_level,
            context_length=i.context_length, modified_at=i.modified_at) for i in self._listed()])

    def _listed(self) -> list:
        for m in self.coordinator.models:
            if m.fingerprint not in self._infos:
                self._infos[m.fingerprint] = model_info.describe(m)
        return [self._infos[m.fingerprint] for m in self.coordinator.models]


class _Health(health.aio.HealthServicer):
    """SERVING while a decode (or colocated) worker is live for every model served, for the
    server ("") and Tandem."""

    def __init__(self, coordinator: Coordinator) -> None:
        super().__init__()
        self.coordinator = coordinator

    async def Check(self, request, context):
        if request.service not in ("", SERVICE_NAME):
            return await super().Check(request, context)
        # The catalog's models, as /health: a model still loading on request is not served yet.
        live = all(self.coordinator.pool(m).has_decode_worker() for m in self.coordinator.models)
        status = (health_pb2.HealthCheckResponse.SERVING if live
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=status)


async def start_client_api(coordinator: Coordinator, host: str, port: int
                           ) -> tuple[grpc.aio.Server, int]:
    """Serve Tandem + health + reflection on host:port (0 = a free port); with an API key,
    every call but health's must carry it (coordinator/access.py); with API TLS files, over
    TLS only (coordinator/api_tls.py)."""
    keys = coordinator.config.api_keys()
    server = new_server(interceptors=[ApiKeyInterceptor(keys)] if keys else None)
    pb_grpc.add_TandemServicer_to_server(TandemServicer(coordinator), server)
    health_pb2_grpc.add_HealthServicer_to_server(_Health(coordinator), server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    tls = coordinator.config.api_tls
    add_port = ((lambda address: server.add_secure_port(address, tls.grpc_credentials()))
                if tls else server.add_insecure_port)
    bound = bind(add_port, f"{host}:{port}", "the gRPC client API")
    await server.start()
    return server, bound
