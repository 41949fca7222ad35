"""What every worker process shares: its entry point (flags in worker/flags.py, config in
worker/config.py), building its engine, the gRPC server with the standard health service, and
registration plus heartbeats with each coordinator. The environment is read at the entry point
(WorkerConfig.from_args), nowhere deeper."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.cluster_auth import PROOF_HEADER, REGISTER_REPLY, ClusterAuth, request_bytes
from engine.config import KV_DTYPE_TORCH_NAMES, EngineConfig
from worker.config import WorkerConfig
from worker.core_share import CoreShare
from worker.engine_loop import EngineLoop
from worker.flags import worker_arg_parser
from common.errors import ResidencyError, TandemError
from common.pooling import Pooling
from engine.prefill_cost import CALIBRATION_TOKENS
from engine.llm_engine import LLMEngine
from kernels import layout_choice, native
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from worker.runtime import configure_process
from common.grpc_server import bind, new_server
from common.malloc_policy import freeze_loaded_heap
from common import request_id
from common.lifeline import watch_launcher
from common.log_format import setup_logging
from common.tracing import endpoint_from, protocol_from, setup_tracing

log = logging.getLogger("tandem.node")

GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def resolve_model(name: str) -> Path:
    from common.model_store import default_store

    return default_store().resolve(name)


def open_core_share(config: WorkerConfig) -> CoreShare | None:
    """This worker's slot of its host's core lease (worker/core_share.py), or None without
    --core-lease; a lease that cannot be read is the worker's start-up error, naming it."""
    if config.core_lease is None:
        return None
    try:
        share = CoreShare.open(config.core_lease, config.core_lease_slot, config.role, config.threads)
    except ValueError as exc:
        raise NodeFailure(str(exc)) from None
    log.info("%s", share.describe())
    return share


def build_engine(config: WorkerConfig, path: Path, sized: EngineConfig | None = None,
                 kv_cache=None, cores: CoreShare | None = None) -> LLMEngine:
    """The worker's engine from `path`: config.engine, or `sized` where the node sized its
    pool itself (a decode worker, around its KV receiver's buffer `kv_cache`). With a core
    lease (`cores`) a decode worker's native pool is made as large as the lease can make it
    and limited to its own share until the engine loop's first step says otherwise."""
    # A decode worker's --threads go to the native pool; torch keeps one (configure_process).
    configure_process(config.threads, torch_threads=1 if config.role == "decode" else None,
                      batch_invariant=config.batch_invariant)
    if cores is not None:
        cores.size_pool()
        layout_choice.set_timing_guard(cores.timing_guard)
    engine = LLMEngine.from_path(path, sized or config.engine, kv_cache=kv_cache,
                                 load_tokenizer=False)  # trims the heap after loading
    if config.role in ("prefill", "decode"):
        # What a prompt token costs here, before the first heartbeat: the coordinator weighs a
        # decode worker's local prefill against a prefill worker's by it (placement.py).
        seconds = engine.calibrate_prefill()
        log.info("%s engine: a prompt token costs %.2f ms (a %d-token pass)", config.role,
                 seconds * 1e3, CALIBRATION_TOKENS)
    log.info("%s engine: weight formats %s, %d %s KV blocks, %d threads (torch %d, native kernels %d%s), "
             "on %s%s", config.role, "+".join(engine.model.formats), engine.config.cache.num_blocks,
             engine.config.cache.kv_dtype, config.threads, torch.get_num_threads(), native.threads(),
             f", {native.active()} active until the core lease lends more" if native.active() else "",
             engine.runner.device,
             " (CUDA graphs)" if engine.runner.graphs is not None else "")
    return engine


def kv_layout(config, block_size: int, kv_dtype: str, model_id: str):
    """The kvtransfer layout of a worker's KV cache; kv_dtype is a KV_DTYPES name ("fp32",
    "bf16"). A prefill worker builds it from its engine's actual cache, a decode worker before
    allocating the cache that its engine then uses."""
    import kvtransfer

    return kvtransfer.KVLayout(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                               head_dim=config.head_dim, block_size=block_size,
                               dtype=KV_DTYPE_TORCH_NAMES[kv_dtype], model_id=model_id)


def worker_status(worker_id: str, role: str, loop: EngineLoop,
                  kv: pb.KVTransferCounters | None = None,
                  refused: ClusterAuth | None = None) -> pb.WorkerStatus:
    """From the engine thread's last published snapshot: the scheduler's own queues belong to
    the engine thread and must not be iterated from here. `kv`: the worker's transfer
    counters (kv_counters); `refused`: the auth whose refused calls the heartbeat reports."""
    snap = loop.snapshot
    config = loop.engine.config
    return pb.WorkerStatus(
        worker_id=worker_id, role=role, num_blocks=snap.num_blocks, num_free_blocks=snap.num_free_blocks,
        num_running=snap.num_running, num_waiting=snap.num_waiting,
        queued_prefill_tokens=snap.queued_prefill_tokens,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        block_size=config.cache.block_size, cached_block_hashes=snap.cached_hashes, kv=kv,
        unloaded=not snap.resident, prefill_token_seconds=snap.prefill_token_seconds,
        spec_decode=None if snap.spec_decode is None else pb.SpecDecodeCounters(
            num_steps=snap.spec_decode.num_steps,
            num_draft_tokens=snap.spec_decode.num_draft_tokens,
            num_accepted_tokens=snap.spec_decode.num_accepted_tokens,
            num_emitted_tokens=snap.spec_decode.num_emitted_tokens,
            method=snap.spec_decode.method),
        refused_calls=[pb.RefusedCalls(method=method, reason=reason, count=count)
                       for (method, reason), count in sorted(
                           (refused.refused.snapshot() if refused else {}).items())])


async def embed_rpc(worker, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResult:
    """Embed of either worker service (proto/worker.proto), over its Embedder."""
    request_id.current.set(request_id.from_metadata(context.invocation_metadata()))
    inputs = [list(t.token_ids) for t in request.inputs]
    if not inputs:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "inputs are required")
    try:
        pooling = Pooling.from_wire(request.pooling)
        vectors = await worker.embedder.embed(inputs, request.normalize, request.max_chunk_tokens,
                                              pooling)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except ResidencyError as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    except RuntimeError as exc:  # the engine loop died: let the coordinator route around us
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.info("embed %s: %d inputs, %d tokens", request.request_id, len(inputs),
             sum(map(len, inputs)))
    return pb.EmbedResult(embeddings=[pb.Embedding(values=v) for v in vectors])


async def set_resident(worker: EngineLoop, request: pb.ResidencyRequest,
                       context: grpc.aio.ServicerContext) -> pb.ResidencyResult:
    """SetResident of either worker service (proto/worker.proto), over its engine loop."""
    try:
        seconds = await worker.set_resident(request.resident)
    except ResidencyError as exc:  # requests are open
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    except RuntimeError as exc:  # the engine loop died
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.info("model %s", "loaded in %.2f s" % seconds if request.resident else "unloaded")
    return pb.ResidencyResult(resident=worker.engine.resident, load_seconds=seconds)


def kv_counters(backend: str, stats, sending: bool) -> pb.KVTransferCounters:
    """kvtransfer.TransferStats (one, or the sum of several) as the heartbeat's counters."""
    stats = list(stats)
    total = dict(bytes=0, done=0, failed=0, seconds=0.0, skipped=0, rejected=0)
    for st in stats:
        total["bytes"] += st.bytes
        total["done"] += st.transfers_done
        total["failed"] += st.transfers_failed
        total["seconds"] += st.seconds
        total["skipped"] += st.skipped_blocks
        total["rejected"] += st.auth_rejected
    return pb.KVTransferCounters(
        backend=backend, bytes_sent=total["bytes"] if sending else 0,
        bytes_received=0 if sending else total["bytes"], transfers_done=total["done"],
        transfers_failed=total["failed"], transfer_seconds=total["seconds"],
        skipped_blocks=total["skipped"], auth_rejected=total["rejected"])


class NodeFailure(TandemError):
    """The worker cannot go on (refused by the coordinator, engine thread dead); the process
    exits with this message after releasing what it holds."""


class CoordinatorLost(NodeFailure):
    """One coordinator stayed unreachable for --coordinator-retry: fatal only when it was the
    last one the worker served (register_everywhere)."""


@dataclass
class NodeIdentity:
    worker_id: str
    role: str
    address: str
    kv_endpoint: str
    kv_backend: str
    model_fingerprint: str
    kv_layout_fingerprint: str  # kvtransfer.KVLayout.description: dtype, geometry, fingerprint


def new_worker_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:8]}"


# The coordinator's verdict that we do not hold the cluster's secret (common/cluster_auth.py):
# retrying cannot help, so it is as fatal as a refused registration.
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


async def register_and_heartbeat(coordinator: str, identity: NodeIdentity,
                                 status: Callable[[], pb.WorkerStatus], stop: asyncio.Event,
                                 auth: ClusterAuth = ClusterAuth(), retry_s: float = 0.0) -> None:
    """Registers (retrying while the coordinator is not up yet), then heartbeats; registers
    again whenever the coordinator has forgotten us. A refusal (e.g. a model mismatch, or no
    cluster secret) is fatal: the worker exits rather than serve a cluster it does not belong
    to. So is a coordinator unreachable for `retry_s` on end (0 = retry forever): a worker on
    another host whose cluster is gone stops rather than hold its memory and ports for good."""
    async with auth.aio_channel(coordinator) as channel:
        stub = pb_grpc.RegistryStub(channel)
        interval = 1.0
        registered = False
        unreachable_since: float | None = None
        while not stop.is_set():
            try:
                if not registered:
                    info = pb.WorkerInfo(worker_id=identity.worker_id, role=identity.role,
                                         address=identity.address, kv_endpoint=identity.kv_endpoint,
                                         kv_backend=identity.kv_backend,
                                         model_fingerprint=identity.model_fingerprint,
                                         kv_layout_fingerprint=identity.kv_layout_fingerprint,
                                         status=status())
                    call = stub.Register(info, timeout=5)
                    reply = await call
                    if auth.secret:
                        await _check_coordinator(auth, coordinator, call, info)
                    if not reply.accepted:
                        log.error("coordinator refused registration: %s", reply.reason)
                        raise NodeFailure(f"registration refused: {reply.reason}")
                    interval = reply.heartbeat_interval_s or interval
                    registered = True
                    log.info("registered with %s as %s", coordinator, identity.worker_id)
                else:
                    reply = await stub.Heartbeat(pb.HeartbeatRequest(worker_id=identity.worker_id,
                                                                     status=status()), timeout=5)
                    registered = reply.known
                unreachable_since = None
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSALS:
                    hint = ("this worker has a cluster secret: is it the coordinator's?" if auth.secret
                            else "give this worker the cluster's secret (--cluster-secret-file "
                                 "or TANDEM_CLUSTER_SECRET)")
                    log.error("coordinator refused us: %s", exc.details())
                    raise NodeFailure(f"registration refused: {exc.details()} ({hint})") from None
                # The details tell a coordinator that is down from a TLS mismatch.
                log.warning("coordinator %s unreachable: %s (%s)", coordinator, exc.code().name,
                            exc.details())
                registered = False
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if retry_s and now - unreachable_since >= retry_s:
                    log.error("coordinator %s unreachable for %.0f s: giving it up "
                              "(--coordinator-retry %g)", coordinator, now - unreachable_since,
                              retry_s)
                    raise CoordinatorLost(f"coordinator {coordinator} unreachable for "
                                      f"{now - unreachable_since:.0f} s (--coordinator-retry "
                                      f"{retry_s:g})") from None
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass


async def register_everywhere(coordinators: tuple[str, ...], identity: NodeIdentity,
                              status: Callable[[], pb.WorkerStatus], stop: asyncio.Event,
                              auth: ClusterAuth = ClusterAuth(), retry_s: float = 0.0) -> None:
    """register_and_heartbeat with every coordinator at once, each on its own task and channel,
    so that a dead or unreachable one never delays another's heartbeats (each coordinator
    declares us dead on its own clock). The KV pool stays ours whoever places a request, so
    coordinators need not know of each other. A refusal by any is fatal (a worker that one
    of its coordinators refuses is misconfigured); a coordinator lost for `retry_s` is given
    up and the others served on, until the last one is lost too."""
    tasks = {asyncio.create_task(register_and_heartbeat(c, identity, status, stop, auth, retry_s),
                                 name=f"registry {c}"): c for c in coordinators}
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                tasks.pop(task)
            # Every done task's exception retrieved before any is raised (none goes unlogged).
            for failure in [task.exception() for task in done]:
                if isinstance(failure, CoordinatorLost) and tasks:
                    log.warning("%s; serving on for %s", failure, ", ".join(tasks.values()))
                elif failure is not None:
                    raise failure
    finally:
        for task in tasks:
            task.cancel()


async def _check_coordinator(auth: ClusterAuth, coordinator: str, call,
                             info: pb.WorkerInfo) -> None:
    """The Registry proves the secret in its reply's trailing metadata, for this very
    registration (`info`) and once: a worker must not serve (and hand its KV endpoint to) a
    coordinator outside the cluster, nor take a replayed reply for an answer."""
    metadata = dict(await call.trailing_metadata() or ())
    reason = auth.admit(REGISTER_REPLY, metadata.get(PROOF_HEADER), body=request_bytes(info))
    if reason:
        raise NodeFailure(f"the coordinator at {coordinator} did not prove the cluster secret: "
                          f"{reason.replace('the caller', 'it')}")


async def watch_engine(engine_loop: EngineLoop, stop: asyncio.Event, period_s: float = 0.5) -> None:
    """Ends the process when the engine thread has died: a worker that can no longer compute
    must stop heartbeating and serving, so the coordinator routes around it at once."""
    while not stop.is_set():
        if not engine_loop.alive:
            raise NodeFailure(f"engine loop died: {engine_loop.fatal}")
        try:
            await asyncio.wait_for(stop.wait(), timeout=period_s)
        except asyncio.TimeoutError:
            pass


async def run_node(config: WorkerConfig, service_name: str,
                   add_servicer: Callable[[grpc.aio.Server], None], identity: NodeIdentity,
                   status: Callable[[], pb.WorkerStatus], engine_loop: EngineLoop,
                   on_stop: Callable[[], Awaitable[None] | None] | None = None) -> None:
    auth = config.cluster_auth or ClusterAuth()
    # With a secret, only the coordinator's calls (they carry its proof) are served.
    server = new_server(options=GRPC_OPTIONS, interceptors=auth.server_interceptors())
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = bind(lambda address: auth.add_port(server, address), f"{config.host}:{config.port}",
                f"the {identity.role} node")
    if config.port == 0:
        # The kernel chose the port at bind, so no other process can take it between a pick and
        # this bind (a launcher that picks ports for its workers races every other bind).
        identity = replace(identity, address=f"{config.advertised}:{port}")
    # Everything loaded so far lives as long as the process: out of the full collections'
    # reach, which would otherwise walk it all and stall every stream (common/malloc_policy.py).
    frozen = freeze_loaded_heap()
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s %s serving on %s:%d (%s; %d loaded objects frozen out of the cyclic GC)",
             identity.role, identity.worker_id, config.host, port, auth.describe(), frozen)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(watch_engine(engine_loop, stop))]
    if config.coordinators:
        tasks.append(asyncio.create_task(register_everywhere(
            config.coordinators, identity, status, stop, auth, config.coordinator_retry_s)))
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failures = [t.exception() for t in done if t is not waiter and t.exception() is not None]
    stop.set()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    for task in tasks:
        task.cancel()
    if failures:  # after the cleanup above: a shared-memory KV cache must not outlive us
        raise failures[0]


def node_main(prog: str, roles: tuple[str, ...], main_async, argv: list[str] | None = None) -> int:
    """A worker process's entry point: parse, build its WorkerConfig once (the cluster auth
    and the device checked before the model loads), log, run main_async(config) on uvloop;
    a bad value or a TandemError is one line and exit status 1."""
    import uvloop

    args = worker_arg_parser(prog, roles).parse_args(argv)
    watch_launcher()  # TANDEM_LIFELINE_FD: end with the launcher that started us
    try:
        setup_logging(args.log_level, args.log_format)
        setup_tracing(f"tandem-{args.role}", endpoint_from(args.otlp_traces_endpoint, os.environ),
                      protocol_from(args.otlp_traces_protocol, os.environ))
        config = WorkerConfig.from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    try:
        uvloop.run(main_async(config))
    except TandemError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    return 0


