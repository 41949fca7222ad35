"""The coordinator as one object: model, worker registry, admission, request flow and metrics,
and the Registry gRPC server that workers call. The HTTP layer talks only to this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import grpc

from coordinator.admission import Admission, Overloaded
from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation
from coordinator.metrics import Metrics, RequestTimings
from coordinator.model import ServedModel
from coordinator.placement import concurrency_limit
from coordinator.registry import DECODE_ROLES, WorkerRegistry, start_registry_server
from coordinator.request_flow import FlowRequest, NoWorkers, RequestFlow
from engine.errors import ContextLengthError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, model: ServedModel) -> None:
        self.config = config
        self.model = model
        self.registry = WorkerRegistry(config, model.fingerprint)
        self.admission = Admission(self._capacity, config.max_queue, config.queue_timeout_s,
                                   config.retry_after_s)
        self.registry.add_listener(self.admission.wake)
        self.flow = RequestFlow(self.registry, config)
        self.metrics = Metrics()
        self.registry_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    def _capacity(self) -> int:
        return concurrency_limit(self.registry.snapshots(DECODE_ROLES),
                                 self.config.max_running_per_worker)

    # ---- life cycle (inside the serving event loop) ---------------------------------------------

    async def start(self) -> None:
        self._server, self.registry_port = await start_registry_server(
            self.registry, self.config.registry_host, self.config.registry_port)
        self._sweeper = asyncio.create_task(self.registry.run_sweeper())
        log.info("registry listening on %s:%d", self.config.registry_host, self.registry_port)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.registry.close()

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt_ids: list[int], params: SamplingParams) -> FlowRequest:
        context = params.context_limit(self.model.context_len)
        max_tokens = params.max_tokens_for(len(prompt_ids), self.model.context_len)
        if max_tokens <= 0:
            raise ContextLengthError(f"the prompt is {len(prompt_ids)} tokens, which leaves no "
                                     f"room in the {context}-token context window")
        return FlowRequest(request_id=uuid.uuid4().hex, prompt_ids=prompt_ids, params=params,
                           max_tokens=max_tokens,
                           stop_token_ids=self.model.tokenizer.stop_token_ids)

    async def begin(self, request: FlowRequest, timings: RequestTimings) -> Generation:
        """Admit the request (waiting in the queue if need be). Raises NoWorkers or Overloaded."""
        if not self.registry.live(DECODE_ROLES):
            self.metrics.count_refusal("overloaded")
            raise NoWorkers("no live decode worker is registered; retry once workers are up")
        try:
            await self.admission.acquire()
        except Overloaded:
            self.metrics.count_refusal("overloaded")
            raise
        timings.admitted = time.monotonic()
        return Generation(request, timings, self.flow, self.model.tokenizer, self.metrics,
                          self.admission.release)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.registry.all(), self.admission.queue_depth,
                                   self.admission.running)

    def workers_report(self) -> dict:
        return {"model": self.model.name, "model_fingerprint": self.model.fingerprint,
                "live": self.registry.live_counts(),
                "workers": [w.describe() for w in self.registry.all()]}
