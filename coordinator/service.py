"""The coordinator as one object: the models it serves (coordinator/model_catalog.py), one pool
per model (coordinator/model_pool.py: its workers, admission, request flow and keep_alive), the
worker registry they share, metrics and its background tasks. A request names its model; every
step after that (limits, tokenizer, admission, placement, keep_alive) is that model's. It starts no transport: coordinator/server.py serves the Registry gRPC
service, the client gRPC API and the HTTP app around it. The API layers talk only to this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable

import grpc

from coordinator.admission import Admission, Overloaded, TooManyStreams
from coordinator.call_cancelled import cancelled_from_outside
from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation
from coordinator.metrics import Metrics, RequestTimings
from coordinator.model import ServedModel
from coordinator.model_catalog import ModelCatalog, not_served_hint
from coordinator.model_pool import ModelPool
from coordinator.on_demand import OnDemandModels
from coordinator.placement import choose_embedder
from coordinator.prompts import off_loop
from coordinator.registry import WorkerRegistry
from coordinator.residency import ModelRetired, Residency
from coordinator.response_cache import ResponseCache, ResponseCacheCollector
from coordinator.request_flow import FlowRequest, NoWorkers, RequestFlow, Siblings, WorkerError
from common import request_id, tracing
from common.pooling import Pooling
from common.errors import ContextLengthError, InvalidOptionError
from common.grammar_compile import check_grammar
from common.model_store import ModelStore
from common.rpc import worker_pb2 as pb
from common.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, config: CoordinatorConfig,
                 models: ServedModel | ModelCatalog | Iterable[ServedModel],
                 store: ModelStore | None = None) -> None:
        """models: the model(s) served, the first being the default (`model`). store: the
        model store behind /api/pull, /api/copy, /api/create and /api/delete
        (coordinator/model_routes.py); None answers those with a 501."""
        self.config = config
        if isinstance(models, ServedModel):
            models = (models,)
        self.models = models if isinstance(models, ModelCatalog) else ModelCatalog(models)
        self.store = store
        if store is not None:
            self.models.missing_hint = lambda name: not_served_hint(store, name)
        self.registry = WorkerRegistry(config, self.models.fingerprints)
        # One pool per model: its workers, admission queue, request flow and keep_alive.
        self.pools = {f: ModelPool(self.registry, f, config) for f in self.models.fingerprints}
        self._worker_waiters: set[asyncio.Future[None]] = set()  # requests awaiting a worker
        self.registry.add_listener(self._wake_worker_waiters)
        self._residency_tasks: dict[str, asyncio.Task] = {}  # fingerprint -> its keep_alive
        # Models loaded on request (coordinator/on_demand.py): set by the entry point when a
        # launcher supervises the workers; None = only the models given at start are served.
        self.on_demand: OnDemandModels | None = None
        self.metrics = Metrics([m.name for m in self.models])  # model_name: each model's own
        # Set by listening() once the transports bound (coordinator/server.py).
        self.registry_port: int | None = None  # the Registry gRPC service, for workers
        self.grpc_port: int | None = None  # the client-facing gRPC API
        self.open_requests = 0  # queued or running, on every API (config.max_streams)
        self._sweeper: asyncio.Task | None = None
        # Opt-in (config.response_cache): answers of repeated requests, served in submit().
        self.response_cache = (ResponseCache(config.response_cache, self.find_model)
                               if config.response_cache is not None else None)
        if self.response_cache is not None:
            self.metrics.registry.register(ResponseCacheCollector(self.response_cache))

    # ---- the models served ----------------------------------------------------------------------

    @property
    def model(self) -> ServedModel:
        """The default model (the first served): what a caller that names none means."""
        return self.models.default

    def pool(self, model: ServedModel | None = None) -> ModelPool:
        return self.pools[(model or self.models.default).fingerprint]

    async def find_model(self, name: str, timings: RequestTimings | None = None) -> ServedModel:
        """The model a request names: a served one, else (models loaded on request) one the
        stores hold, loaded first, the wait counted in timings.load_wait (Ollama's
        load_duration); ModelNotFoundError (404) otherwise."""
        if self.on_demand is None:
            return self.models.get(name)
        start = time.monotonic()
        model = await self.on_demand.get(name)
        if timings is not None:
            timings.load_wait += time.monotonic() - start
        return model

    async def described_model(self, name: str) -> ServedModel:
        """The model a route that never loads names (/api/show, /v1/models/NAME): a served
        one, else (models loaded on request) one the stores hold, read but not loaded, as
        Ollama shows any model of its store; ModelNotFoundError (404) otherwise."""
        model = self.models.find(name)
        if model is None and self.on_demand is not None:
            model = await self.on_demand.describe(name)
        return model if model is not None else self.models.get(name)

    async def listed_models(self) -> list[ServedModel]:
        """What the model listings show: the served models, then (models loaded on request)
        those the stores hold, read but not loaded."""
        held = await self.on_demand.held() if self.on_demand is not None else []
        return [*self.models, *held]

    async def _live_pool(self, model: ServedModel) -> tuple[ServedModel, ModelPool]:
        """The model and its pool; a model loaded on request that was unloaded since the
        request looked it up is loaded again (the same file: the same tokenizer)."""
        pool = self.pools.get(model.fingerprint)
        if pool is None or pool.retired:
            if self.on_demand is None:
                raise NoWorkers(f"model {model.name} is no longer served")
            model = await self.on_demand.get(model.name)
            pool = self.pools[model.fingerprint]
        return model, pool

    # ---- models added and removed at run time (coordinator/on_demand.py) ------------------------

    def add_model_pool(self, model: ServedModel, on_expire) -> None:
        """A pool for a model loading on request: the registry accepts its workers from now
        on; requests find it once publish_model put it in the catalog."""
        self.registry.add_model(model.fingerprint)
        pool = ModelPool(self.registry, model.fingerprint, self.config, on_expire=on_expire)
        self.pools[model.fingerprint] = pool
        self._residency_tasks[model.fingerprint] = asyncio.create_task(pool.residency.run())
        self.metrics.add_model(model.name)

    def publish_model(self, model: ServedModel) -> None:
        """Its workers registered: requests, /api/ps and /api/tags see it."""
        self.models.add(model)

    def retire_model(self, fingerprint: str) -> None:
        """No request starts on this model again (synchronous: nothing interleaves); its
        workers are stopped by the caller. Requests waiting for a worker of it look again."""
        pool = self.pools.pop(fingerprint, None)
        if pool is not None:
            pool.retire()
        task = self._residency_tasks.pop(fingerprint, None)
        if task is not None:  # keep_alive's own task, when it unloads: cancelled at its next wait
            task.cancel()
        if fingerprint in self.models.fingerprints:
            self.models.remove(fingerprint)
        self._wake_worker_waiters()

    # The default model's pool, for callers that serve one model.
    @property
    def admission(self) -> Admission:
        return self.pool().admission

    @property
    def flow(self) -> RequestFlow:
        return self.pool().flow

    @property
    def residency(self) -> Residency:
        return self.pool().residency

    # ---- life cycle (inside the serving event loop) ---------------------------------------------

    async def start(self) -> None:
        """The background tasks: the registry's sweeper and keep_alive's residency. The
        transports around this object are started by coordinator/server.py."""
        self._sweeper = asyncio.create_task(self.registry.run_sweeper())
        if self.on_demand is not None:
            await self.on_demand.start()
        self._residency_tasks = {f: asyncio.create_task(p.residency.run())
                                 for f, p in self.pools.items()}

    def listening(self, registry_port: int, grpc_port: int) -> None:
        """Where the transports bound (coordinator/server.py): the registry's and the client
        gRPC API's ports, for /internal/workers and the launchers that read them."""
        self.registry_port, self.grpc_port = registry_port, grpc_port

    async def stop(self) -> None:
        """Cancels the background tasks (the transports are stopped by coordinator/server.py)."""
        if self.on_demand is not None:
            await self.on_demand.close()
        for task in (self._sweeper, *self._residency_tasks.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # ---- requests -------------------------------------------------------------------------------

    def prepare(self, prompt_ids: list[int], params: SamplingParams,
                cache_salt: bytes = b"", model: ServedModel | None = None,
                siblings: Siblings | None = None) -> FlowRequest:
        """Check a request against its model's limits (model None: the default model); raises
        a TandemError naming the limit. cache_salt: the caller's prefix-cache tenant
        (coordinator/tenants.py); siblings: shared by the choices of one request.

        A prompt longer than the context window is an error, never silently truncated."""
        model = model or self.model
        limit = model.context_len
        if params.num_ctx is not None and params.num_ctx > limit:
            raise InvalidOptionError(f"option 'num_ctx' is {params.num_ctx}, above the model's "
                                     f"context length of {limit} tokens")
        context = params.context_limit(limit)
        if params.num_predict > context:
            raise InvalidOptionError(f"option 'num_predict' is {params.num_predict}, more than "
                                     f"the {context}-token context window")
        vocab = model.config.vocab_size
        named = [("token id", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                 ("logit_bias", [t for t, _ in params.logit_bias])]
        for what, ids in named:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidOptionError(f"{what} {bad} is outside the vocabulary "
                                         f"(0..{vocab - 1})")
        if not prompt_ids:
            raise InvalidOptionError("the prompt is empty")
        max_tokens = params.max_tokens_for(len(prompt_ids), model.context_len)
        if max_tokens <= 0:
            raise ContextLengthError(f"the prompt is {len(prompt_ids)} tokens, which leaves no "
                                     f"room in the {context}-token context window")
        # The stop set both workers get: the model's end-of-text tokens unless ignore_eos,
        # and the client's stop_token_ids.
        model_stops = frozenset() if params.ignore_eos else model.tokenizer.stop_token_ids
        # log_id: the id of the API call being served (set by coordinator/access_log.py or
        # the gRPC API), so the workers' log lines about this request carry it too.
        return FlowRequest(request_id=uuid.uuid4().hex, prompt_ids=prompt_ids, params=params,
                           max_tokens=max_tokens,
                           stop_token_ids=model_stops | frozenset(params.stop_token_ids),
                           cache_salt=cache_salt, log_id=request_id.current.get(),
                           siblings=siblings)

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     timings: RequestTimings, keep_alive_s: float | None = None,
                     cache_salt: bytes = b"", model: ServedModel | None = None,
                     siblings: Siblings | None = None, turn: str | None = None) -> Generation:
        """prepare + begin, for every client API; `timings` started when the request arrived.
        A grammar that does not compile is refused here (InvalidOptionError: a 400).
        keep_alive_s: how long the model stays loaded after this request (None = the
        server's default; math.inf = forever). cache_salt: the caller's prefix-cache tenant.
        model: the model the request named (None: the default model). siblings: shared by the
        choices of one request (coordinator/choices.py). turn: the last user turn's text, for
        the semantic response cache (coordinator/response_cache.py)."""
        timings.prompt_tokens = len(prompt_ids)
        request = self.prepare(prompt_ids, params, cache_salt, model, siblings)
        if params.grammar is not None:
            # In-process (llguidance, torch-free), off the loop: a large grammar takes a while.
            await off_loop(check_grammar, params.grammar)
        if self.response_cache is not None:
            model = model or self.model
            return await self.response_cache.submit(request, timings, keep_alive_s, model,
                                                    self.metrics.of(model.name), self.begin,
                                                    self.embed, turn)
        return await self.begin(request, timings, keep_alive_s, model)

    async def begin(self, request: FlowRequest, timings: RequestTimings,
                    keep_alive_s: float | None = None,
                    model: ServedModel | None = None) -> Generation:
        """Admit the request among its model's workers (waiting for a live decode worker of
        it, for the model to load on them, then in its queue, if need be). Raises NoWorkers
        or Overloaded."""
        model = model or self.model
        if self.open_requests >= self.config.max_streams:
            self.metrics.count_refusal("overloaded")
            raise TooManyStreams(f"too many concurrent requests: {self.open_requests} open "
                                 f"(limit {self.config.max_streams})", self.config.retry_after_s)
        self.open_requests += 1
        held = False  # counted in flight by residency
        pool = None
        try:
            # The wait for a live decode worker, the model's weights and a running slot.
            with tracing.current_span("admission", attributes={"tandem.model": model.name}):
                model, pool = await self._hold(model, timings)
                held = True
                await pool.admission.acquire()
        except BaseException as exc:  # NoWorkers, Overloaded, or the client left while waiting
            self.open_requests -= 1
            if held:
                pool.residency.release(keep_alive_s)
            if isinstance(exc, (NoWorkers, Overloaded)):
                self.metrics.count_refusal("overloaded")
            raise
        timings.admitted = time.monotonic()
        return Generation(request, timings, pool.flow, model.tokenizer,
                          self.metrics.of(model.name),
                          lambda: self._release(pool, keep_alive_s))

    async def _hold(self, model: ServedModel, timings: RequestTimings
                    ) -> tuple[ServedModel, ModelPool]:
        """Wait for a live decode worker of the model and count the request in flight on its
        residency (loading the weights back if keep_alive dropped them); the model and pool
        it is counted on. A model loaded on request that is unloaded meanwhile is looked up
        (so loaded) again: a few times at most, each a real unload of an idle model."""
        for attempt in range(3):
            model, pool = await self._live_pool(model)
            try:
                await self._wait_for_decode_worker(timings, pool)
                timings.load_wait += await pool.residency.acquire()
                return model, pool
            except ModelRetired:
                if attempt == 2:
                    raise NoWorkers(f"model {model.name} was unloaded while this request "
                                    "waited for it, three times; retry") from None
        raise AssertionError("unreachable")

    async def preload(self, keep_alive_s: float | None,
                      model: ServedModel | None = None) -> None:
        """A request with no prompt (Ollama's load/unload) for `model` (None: the default):
        keep_alive 0 unloads it from its workers now (or once its requests in flight end);
        any other value loads it and sets its expiry. Other models stay as they are."""
        model = model or self.model
        pool = self.pools.get(model.fingerprint)
        if keep_alive_s == 0:
            if pool is not None and not pool.retired:
                await pool.residency.unload()
            return
        if pool is not None and not pool.retired and pool.residency.resident:
            await pool.residency.acquire()  # nothing to wait for: only the expiry moves
        else:
            _, pool = await self._hold(model, RequestTimings())
        pool.residency.release(keep_alive_s)

    async def embed(self, inputs: list[list[int]], normalize: bool,
                    timings: RequestTimings,
                    model: ServedModel | None = None,
                    pooling: Pooling = Pooling.MEAN) -> list[list[float]]:
        """Pooled embeddings of `inputs` (token ids, each checked against the context by the
        caller) from one worker's Embed RPC (proto/worker.proto): a prefill worker's when one
        is live, else a decode worker's (placement.choose_embedder). A worker that is gone
        (UNAVAILABLE) is marked dead and the next one asked."""
        if self.open_requests >= self.config.max_streams:
            self.metrics.count_refusal("overloaded")
            raise TooManyStreams(f"too many concurrent requests: {self.open_requests} open "
                                 f"(limit {self.config.max_streams})", self.config.retry_after_s)
        self.open_requests += 1
        pool = None
        held = admitted = False
        try:
            model, pool = await self._hold(model or self.model, timings)
            workers_of_model = pool.workers
            held = True
            # Admitted like a prompt: an embedding holds a running slot while it computes.
            await pool.admission.acquire()
            admitted = True
            timings.admitted = time.monotonic()
            tried: list[str] = []
            while True:
                workers = [w for w in workers_of_model.snapshots() if w.worker_id not in tried]
                chosen = choose_embedder(workers, inputs)
                if chosen is None:
                    raise NoWorkers("no live worker can compute embeddings now; retry once "
                                    "workers are up")
                record = workers_of_model.get(chosen.worker_id)
                tried.append(record.worker_id)
                self.registry.assign(record, requests=1)
                on_prefill = record.role == "prefill"
                # The chunk plan of the worker's role: a decode worker takes a long input in
                # local-prefill chunks, so a concurrent stream waits one short pass at a time.
                request = pb.EmbedRequest(
                    request_id=uuid.uuid4().hex, normalize=normalize, pooling=pooling.wire,
                    inputs=[pb.TokenIds(token_ids=ids) for ids in inputs],
                    max_chunk_tokens=self.config.chunk_size if on_prefill
                    else self.config.local_chunk_size)
                stub = record.prefill_stub if on_prefill else record.decode_stub
                try:
                    result = await stub.Embed(request, timeout=self.config.prefill_timeout_s,
                                              metadata=request_id.metadata(
                                                  request_id.current.get()))
                    return [list(e.values) for e in result.embeddings]
                except asyncio.CancelledError:
                    if cancelled_from_outside():
                        raise
                    continue  # its channel closed under the call: declared dead, try another
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
                    self.registry.assign(record, requests=-1)
        finally:
            self.open_requests -= 1
            if admitted:
                pool.admission.release()
            if held:
                pool.residency.release(None)

    async def _wait_for_decode_worker(self, timings: RequestTimings, pool: ModelPool) -> None:
        """Return once a decode worker of the pool's model is live, waiting up to
        config.load_timeout_s.

        Workers register only after loading their model, so this wait is the time the request
        spent waiting for a model load (a worker starting, or restarted after a crash): Ollama's
        load_duration (timings.load_wait). It stays exactly 0.0 when a worker was live. A reload
        after keep_alive expired is residency.acquire's wait, added to the same figure."""
        if pool.has_decode_worker():
            return
        start = time.monotonic()
        deadline = start + self.config.load_timeout_s
        while not pool.has_decode_worker():
            if pool.retired:
                raise ModelRetired("the model was unloaded")
            left = deadline - time.monotonic()
            if left <= 0:
                waited = (f" (waited {self.config.load_timeout_s:g} s for one to load the model)"
                          if self.config.load_timeout_s > 0 else "")
                name = self.models.by_fingerprint(pool.fingerprint).name
                raise NoWorkers(f"no live decode worker of {name} is registered{waited}; "
                                "retry once workers are up")
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

    # ---- the served models' names (/api/copy, /api/create, /api/delete) ------------------------

    def add_model_name(self, name: str, model: ServedModel | None = None) -> None:
        """Requests may name `model` (None: the default) `name` too (a copy of it was made)."""
        self.models.add_name(model or self.model, name)

    def drop_model_name(self, name: str) -> None:
        """`name` was deleted from the store. The names a model was served under (its name,
        its path, the path's file name and stem) stay."""
        self.models.drop_name(name)

    def _release(self, pool: ModelPool, keep_alive_s: float | None = None) -> None:
        self.open_requests -= 1
        pool.admission.release()
        pool.residency.release(keep_alive_s)

    def render_metrics(self) -> bytes:
        pools = self.pools.values()
        per_model = {m.name: (self.pool(m).admission.queue_depth, self.pool(m).admission.running,
                              m.fingerprint) for m in self.models}
        return self.metrics.render(self.registry.all(), sum(p.admission.queue_depth for p in pools),
                                   sum(p.admission.running for p in pools),
                                   self.config.cluster_auth.refused.snapshot(), per_model)

    def workers_report(self) -> dict:
        return {"model": self.model.name, "model_fingerprint": self.model.fingerprint,
                "models": [{"name": m.name, "model_fingerprint": m.fingerprint,
                            "live": self.registry.live_counts(m.fingerprint)}
                           for m in self.models],
                "grpc_port": self.grpc_port,
                "live": self.registry.live_counts(),
                "workers": [w.describe() for w in self.registry.all()]}
