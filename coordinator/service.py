"""The coordinator as one object: model, worker registry, admission, request flow, metrics and
its background tasks. It starts no transport: coordinator/server.py serves the Registry gRPC
service, the client gRPC API and the HTTP app around it. The API layers talk only to this."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import grpc

from coordinator.admission import Admission, Overloaded, TooManyStreams
from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation
from coordinator.metrics import Metrics, RequestTimings
from coordinator.model import ServedModel
from coordinator.placement import choose_embedder, concurrency_limit
from coordinator.prompts import off_loop
from coordinator.registry import DECODE_ROLES, WorkerRegistry
from coordinator.residency import Residency
from coordinator.request_flow import FlowRequest, NoWorkers, RequestFlow, Siblings, WorkerError
from common import request_id
from common.errors import ContextLengthError, InvalidOptionError
from common.grammar_compile import check_grammar
from common.model_store import ModelStore
from common.rpc import worker_pb2 as pb
from common.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, model: ServedModel,
                 store: ModelStore | None = None) -> None:
        """store: the model store behind /api/pull, /api/copy, /api/create and /api/delete
        (coordinator/model_routes.py); None answers those with a 501."""
        self.config = config
        self.model = model
        self.store = store
        self.registry = WorkerRegistry(config, model.fingerprint)
        self.admission = Admission(self._capacity, config.max_queue, config.queue_timeout_s,
                                   config.retry_after_s)
        self.registry.add_listener(self.admission.wake)
        self._worker_waiters: set[asyncio.Future[None]] = set()  # requests awaiting a worker
        self.registry.add_listener(self._wake_worker_waiters)
        self.flow = RequestFlow(self.registry, config)
        # keep_alive: loads the model on the workers before a request, drops it after expiry.
        self.residency = Residency(self.registry, config.keep_alive_s, config.prefill_timeout_s)
        self._residency_task: asyncio.Task | None = None
        self.metrics = Metrics(model.name)
        # Set by listening() once the transports bound (coordinator/server.py).
        self.registry_port: int | None = None  # the Registry gRPC service, for workers
        self.grpc_port: int | None = None  # the client-facing gRPC API
        self.open_requests = 0  # queued or running, on every API (config.max_streams)
        self._sweeper: asyncio.Task | None = None

    def _capacity(self) -> int:
        return concurrency_limit(self.registry.snapshots(DECODE_ROLES),
                                 self.config.max_running_per_worker)

    # ---- life cycle (inside the serving event loop) ---------------------------------------------

    async def start(self) -> None:
        """The background tasks: the registry's sweeper and keep_alive's residency. The
        transports around this object are started by coordinator/server.py."""
        self._sweeper = asyncio.create_task(self.registry.run_sweeper())
        self._residency_task = asyncio.create_task(self.residency.run())

    def listening(self, registry_port: int, grpc_port: int) -> None:
        """Where the transports bound (coordinator/server.py): the registry's and the client
        gRPC API's ports, for /internal/workers and the launchers that read them."""
        self.registry_port, self.grpc_port = registry_port, grpc_port

    async def stop(self) -> None:
        """Cancels the background tasks (the transports are stopped by coordinator/server.py)."""
        for task in (self._sweeper, self._residency_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt_ids: list[int], params: SamplingParams,
                cache_salt: bytes = b"", siblings: Siblings | None = None) -> FlowRequest:
        """Check a request against the model's limits; raises a TandemError naming the limit.
        cache_salt: the caller's prefix-cache tenant (coordinator/tenants.py).

        A prompt longer than the context window is an error, never silently truncated."""
        limit = self.model.context_len
        if params.num_ctx is not None and params.num_ctx > limit:
            raise InvalidOptionError(f"option 'num_ctx' is {params.num_ctx}, above the model's "
                                     f"context length of {limit} tokens")
        context = params.context_limit(limit)
        if params.num_predict > context:
            raise InvalidOptionError(f"option 'num_predict' is {params.num_predict}, more than "
                                     f"the {context}-token context window")
        vocab = self.model.config.vocab_size
        named = [("token id", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                 ("logit_bias", [t for t, _ in params.logit_bias])]
        for what, ids in named:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidOptionError(f"{what} {bad} is outside the vocabulary "
                                         f"(0..{vocab - 1})")
        if not prompt_ids:
            raise InvalidOptionError("the prompt is empty")
        max_tokens = params.max_tokens_for(len(prompt_ids), self.model.context_len)
        if max_tokens <= 0:
            raise ContextLengthError(f"the prompt is {len(prompt_ids)} tokens, which leaves no "
                                     f"room in the {context}-token context window")
        # The stop set both workers get: the model's end-of-text tokens unless ignore_eos,
        # and the client's stop_token_ids.
        model_stops = frozenset() if params.ignore_eos else self.model.tokenizer.stop_token_ids
        # log_id: the id of the API call being served (set by coordinator/access_log.py or
        # the gRPC API), so the workers' log lines about this request carry it too.
        return FlowRequest(request_id=uuid.uuid4().hex, prompt_ids=prompt_ids, params=params,
                           max_tokens=max_tokens,
                           stop_token_ids=model_stops | frozenset(params.stop_token_ids),
                           cache_salt=cache_salt, log_id=request_id.current.get(),
                           siblings=siblings)

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     timings: RequestTimings, keep_alive_s: float | None = None,
                     cache_salt: bytes = b"", siblings: Siblings | None = None) -> Generation:
        """prepare + begin, for every client API; `timings` started when the request arrived.
        A grammar that does not compile is refused here (InvalidOptionError: a 400).
        keep_alive_s: how long the model stays loaded after this request (None = the
        server's default; math.inf = forever). cache_salt: the caller's prefix-cache tenant.
        siblings: shared by the choices of one request (coordinator/choices.py)."""
        timings.prompt_tokens = len(prompt_ids)
        request = self.prepare(prompt_ids, params, cache_salt, siblings)
        if params.grammar is not None:
            # In-process (llguidance, torch-free), off the loop: a large grammar takes a while.
            await off_loop(check_grammar, params.grammar)
        return await self.begin(request, timings, keep_alive_s)

    async def begin(self, request: FlowRequest, timings: RequestTimings,
                    keep_alive_s: float | None = None) -> Generation:
        """Admit the request (waiting for a live decode worker, for the model to load on the
        workers, then in the queue, if need be). Raises NoWorkers or Overloaded."""
        if self.open_requests >= self.config.max_streams:
            self.metrics.count_refusal("overloaded")
            raise TooManyStreams(f"too many concurrent requests: {self.open_requests} open "
                                 f"(limit {self.config.max_streams})", self.config.retry_after_s)
        self.open_requests += 1
        held = False  # counted in flight by residency
        try:
            await self._wait_for_decode_worker(timings)
            timings.load_wait += await self.residency.acquire()
            held = True
            await self.admission.acquire()
        except BaseException as exc:  # NoWorkers, Overloaded, or the client left while waiting
            self.open_requests -= 1
            if held:
                self.residency.release(keep_alive_s)
            if isinstance(exc, (NoWorkers, Overloaded)):
                self.metrics.count_refusal("overloaded")
            raise
        timings.admitted = time.monotonic()
        return Generation(request, timings, self.flow, self.model.tokenizer, self.metrics,
                          lambda: self._release(keep_alive_s))

    async def preload(self, keep_alive_s: float | None) -> None:
        """A request with no prompt (Ollama's load/unload): keep_alive 0 unloads the model
        from the workers now (or once the requests in flight end); any other value loads it
        and sets its expiry."""
        if keep_alive_s == 0:
            await self.residency.unload()
            return
        if not self.residency.resident:  # else nothing to wait for: only the expiry moves
            await self._wait_for_decode_worker(RequestTimings())
        await self.residency.acquire()
        self.residency.release(keep_alive_s)

    async def embed(self, inputs: list[list[int]], normalize: bool,
                    timings: RequestTimings) -> list[list[float]]:
        """Pooled embeddings of `inputs` (token ids, each checked against the context by the
        caller) from one worker's Embed RPC (proto/worker.proto): a prefill worker's when one
        is live, else a decode worker's (placement.choose_embedder). A worker that is gone
        (UNAVAILABLE) is marked dead and the next one asked."""
        if self.open_requests >= self.config.max_streams:
            self.metrics.count_refusal("overloaded")
            raise TooManyStreams(f"too many concurrent requests: {self.open_requests} open "
                                 f"(limit {self.config.max_streams})", self.config.retry_after_s)
        self.open_requests += 1
        held = admitted = False
        try:
            await self._wait_for_decode_worker(timings)
            timings.load_wait += await self.residency.acquire()
            held = True
            # Admitted like a prompt: an embedding holds a running slot while it computes.
            await self.admission.acquire()
            admitted = True
            timings.admitted = time.monotonic()
            tried: list[str] = []
            while True:
                workers = [w for w in self.registry.snapshots() if w.worker_id not in tried]
                chosen = choose_embedder(workers, inputs)
                if chosen is None:
                    raise NoWorkers("no live worker can compute embeddings now; retry once "
                                    "workers are up")
                record = self.registry.get(chosen.worker_id)
                tried.append(record.worker_id)
                self.registry.assign(record.worker_id, requests=1)
                on_prefill = record.role == "prefill"
                # The chunk plan of the worker's role: a decode worker takes a long input in
                # local-prefill chunks, so a concurrent stream waits one short pass at a time.
                request = pb.EmbedRequest(
                    request_id=uuid.uuid4().hex, normalize=normalize,
                    inputs=[pb.TokenIds(token_ids=ids) for ids in inputs],
                    max_chunk_tokens=self.config.chunk_size if on_prefill
                    else self.config.local_chunk_size)
                stub = record.prefill_stub if on_prefill else record.decode_stub
                try:
                    result = await stub.Embed(request, timeout=self.config.prefill_timeout_s,
                                              metadata=request_id.metadata(
                                                  request_id.current.get()))
                    return [list(e.values) for e in result.embeddings]
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.registry.mark_dead(record.worker_id, f"Embed: {exc.details()}")
                        continue
                    if code == grpc.StatusCode.INVALID_ARGUMENT:
                        raise InvalidOptionError(exc.details()) from None
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise Overloaded(exc.details(), self.config.retry_after_s) from None
                    raise WorkerError(f"{record.role} worker {record.worker_id} at {record.address} "
                                      f"failed to embed: {code.name}: {exc.details()}") from None
                finally:
                    self.registry.assign(record.worker_id, requests=-1)
        finally:
            self.open_requests -= 1
            if admitted:
                self.admission.release()
            if held:
                self.residency.release(None)

    async def _wait_for_decode_worker(self, timings: RequestTimings) -> None:
        """Return once a decode worker is live, waiting up to config.load_timeout_s.

        Workers register only after loading their model, so this wait is the time the request
        spent waiting for a model load (a worker starting, or restarted after a crash): Ollama's
        load_duration (timings.load_wait). It stays exactly 0.0 when a worker was live. A reload
        after keep_alive expired is residency.acquire's wait, added to the same figure."""
        if self.registry.live(DECODE_ROLES):
            return
        start = time.monotonic()
        deadline = start + self.config.load_timeout_s
        while not self.registry.live(DECODE_ROLES):
            left = deadline - time.monotonic()
            if left <= 0:
                waited = (f" (waited {self.config.load_timeout_s:g} s for one to load the model)"
                          if self.config.load_timeout_s > 0 else "")
                raise NoWorkers(f"no live decode worker is registered{waited}; retry once "
                                "workers are up")
            waiter = asyncio.get_running_loop().create_future()
            self._worker_waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except asyncio.TimeoutError:
                pass  # the loop condition decides
            finally:
                self._worker_waiters.discard(waiter)
        timings.load_wait = time.monotonic() - start

    def _wake_worker_waiters(self) -> None:
        """Registry listener: a worker registered, heartbeat or died; waiters look again."""
        for waiter in self._worker_waiters:
            if not waiter.done():
                waiter.set_result(None)

    # ---- the served model's names (/api/copy, /api/create, /api/delete) -------------------------

    def add_model_name(self, name: str) -> None:
        """Requests may name the served model `name` too (a copy of it was made)."""
        self.model = dataclasses.replace(self.model, names=self.model.names | {name})

    def drop_model_name(self, name: str) -> None:
        """`name` was deleted from the store. The names the model was served under (its name,
        its path, the path's file name and stem) stay."""
        path = self.model.path
        if name not in (self.model.name, str(path), path.name, path.stem):
            self.model = dataclasses.replace(self.model, names=self.model.names - {name})

    def _release(self, keep_alive_s: float | None = None) -> None:
        self.open_requests -= 1
        self.admission.release()
        self.residency.release(keep_alive_s)

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.registry.all(), self.admission.queue_depth,
                                   self.admission.running,
                                   self.config.cluster_auth.refused.snapshot())

    def workers_report(self) -> dict:
        return {"model": self.model.name, "model_fingerprint": self.model.fingerprint,
                "grpc_port": self.grpc_port,
                "live": self.registry.live_counts(),
                "workers": [w.describe() for w in self.registry.all()]}
