"""Worker registry: who is serving, where, with what model and KV layout, and whether alive.

Workers call Register once at start (and again whenever a Heartbeat answers known=false), then
Heartbeat every `heartbeat_interval_s` with their WorkerStatus. A worker is routed to only
while it is alive:

    Register(accepted) -> alive --(no heartbeat for heartbeat_misses intervals)--> dead
                          alive --(an RPC to it fails with UNAVAILABLE)-----------> dead
                          dead  --(Register again)----------------------------------> alive

A worker silent for half the deadline is probed with its Status RPC; an answer counts as a
heartbeat (a worker whose heartbeats are lost but which serves stays routable).

Silence is measured on the coordinator's own responsive time, not the wall clock: if its event
loop stalls (a long GC pause, a blocking call), the heartbeats that workers sent meanwhile wait
unread in the socket, and a stall must not be blamed on them. The sweeper ticks every half
interval; time between two ticks beyond one heartbeat interval is the coordinator's stall and
does not count as any worker's silence (`responsive_now`).

A dead worker's Heartbeat answers known=false, so a worker that was only cut off for a while
registers again and is revived with a fresh channel.

A worker id is bound to what its live record registered with: the address and, under mutual
TLS, the certificate identity the Registry saw (with a secret, only holders of it get this
far at all). A registration of a live id that matches both is the same worker registering
again and is accepted; one from elsewhere is a claim on a name in use. The Registry then asks
the holder for its Status (the silent-worker probe, same deadline): the claim is refused while
the holder answers (logged, and counted with the refused calls as reason id_in_use), and
accepted once it does not (the holder is declared dead first). Without this a second process
started by hand as `decode-0` would take over the first one's traffic. Records of dead workers are kept so that
/internal/workers can show them.

Each status (Register's, every Heartbeat's) replaces the worker's load, the hashes of the blocks
its prefix cache holds (a fresh frozenset, for prefix-aware placement) and its KV transfer
counters (for /metrics).

The coordinator also counts what it has itself sent to each worker (`assigned_*`): heartbeats
are up to one interval old, and placement must not send a burst of requests to one worker
because its last report looked idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import grpc

from coordinator.call_cancelled import cancelled_from_outside
from coordinator.config import CoordinatorConfig
from coordinator.convert import (
    KVCounters, SpecDecodeCounters, WorkerLoad, kv_from_status, load_from_status,
    refused_from_status, spec_from_status,
)
from common.cluster_auth import PROOF_HEADER, REGISTER_METHOD, REGISTER_REPLY, request_bytes
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from common.grpc_server import bind, new_server

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")
DECODE_ROLES = ("decode", "colocated")  # roles that run Generate streams


@dataclass(frozen=True)
class WorkerSnapshot:
    """What placement sees of one live worker."""

    worker_id: str
    role: str
    kv_backend: str
    kv_layout_fingerprint: str
    load: WorkerLoad
    assigned_requests: int = 0  # requests this coordinator has running there now
    assigned_prefill_tokens: int = 0  # prompt tokens this coordinator has sent it to prefill
    released_blocks: int = 0  # KV blocks of this coordinator's requests that ended there
                              # since its last status (which still counts them as used)
    released_requests: int = 0  # ... and those requests (it still counts them running)


@dataclass
class WorkerRecord:
    worker_id: str
    role: str
    address: str  # host:port of its gRPC server
    kv_endpoint: str
    kv_backend: str
    model_fingerprint: str
    kv_layout_fingerprint: str
    channel: grpc.aio.Channel
    load: WorkerLoad
    last_heartbeat: float  # the registry's responsive time (seconds), see responsive_now
    alive: bool = True
    dead_reason: str = ""
    assigned_requests: int = 0
    assigned_prefill_tokens: int = 0
    released_blocks: int = 0  # see WorkerSnapshot; back to 0 at each status
    released_requests: int = 0
    # Statuses received: a request's flow compares the count from its first decoded token on,
    # to tell whether a status saw its KV (request_flow.py; released_blocks).
    statuses: int = 0
    registrations: int = 1
    kv: KVCounters | None = None  # its KV transfer counters, as last reported
    spec: SpecDecodeCounters | None = None  # its speculative decoding counters, as last reported
    # Internal calls it refused, (method, reason) -> count, as last reported.
    refused: dict[tuple[str, str], int] = field(default_factory=dict)
    resident: bool = True  # it holds the model's weights, as last reported (keep_alive)
    # Its TLS certificate identity as the Registry saw it ("" without TLS): with the address,
    # what its id is bound to.
    identity: str = ""
    prefill_stub: pb_grpc.PrefillWorkerStub | None = field(default=None, repr=False)
    decode_stub: pb_grpc.DecodeWorkerStub | None = field(default=None, repr=False)

    def new_status(self) -> None:
        """A status replaced the load: it counts what ended before it."""
        self.statuses += 1
        self.released_blocks = self.released_requests = 0

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(self.worker_id, self.role, self.kv_backend,
                              self.kv_layout_fingerprint, self.load, self.assigned_requests,
                              self.assigned_prefill_tokens, self.released_blocks,
                              self.released_requests)

    def describe(self) -> dict:
        """JSON-ready view for /internal/workers."""
        load = self.load
        return {
            "worker_id": self.worker_id, "role": self.role, "address": self.address,
            "alive": self.alive, "dead_reason": self.dead_reason or None,
            "kv_endpoint": self.kv_endpoint, "kv_backend": self.kv_backend,
            "model_fingerprint": self.model_fingerprint,
            "kv_layout_fingerprint": self.kv_layout_fingerprint,
            "num_blocks": load.num_blocks, "num_free_blocks": load.num_free_blocks,
            "num_running": load.num_running, "num_waiting": load.num_waiting,
            "queued_prefill_tokens": load.queued_prefill_tokens,
            "prefill_token_seconds": load.prefill_token_seconds,
            "cached_blocks": len(load.cached_hashes),
            "assigned_requests": self.assigned_requests,
            "assigned_prefill_tokens": self.assigned_prefill_tokens,
            "released_blocks": self.released_blocks,
            "released_requests": self.released_requests, "resident": self.resident,
            "kv": asdict(self.kv) if self.kv is not None else None,
            "spec_decode": asdict(self.spec) if self.spec is not None else None,
        }


class WorkerRegistry:
    def __init__(self, config: CoordinatorConfig, model_fingerprints: str | Iterable[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """model_fingerprints: the models served (one fingerprint, or several); a worker of
        any other model is refused. `view(fingerprint)` is one model's part of the registry."""
        self.config = config
        self.model_fingerprints = frozenset(
            (model_fingerprints,) if isinstance(model_fingerprints, str) else model_fingerprints)
        if not self.model_fingerprints:
            raise ValueError("a registry needs at least one model fingerprint")
        self._clock = clock
        self._workers: dict[str, WorkerRecord] = {}
        self._listeners: list[Callable[[], None]] = []
        self._tick_at: float | None = None  # clock() at the sweeper's last tick
        self.stalled_s = 0.0  # the coordinator's own stalls so far, not counted as silence
        self._probing: set[str] = set()  # workers with a Status probe in flight
        self.probes_answered = 0  # silent workers that answered a Status probe (a metric)

    # ---- the coordinator's responsive time ------------------------------------------------------

    @property
    def _max_tick_gap_s(self) -> float:
        # The sweeper sleeps half an interval; a tick up to one interval late is normal.
        return self.config.heartbeat_interval_s * 1.5

    def responsive_now(self) -> float:
        """The clock less the coordinator's own stalls: a gap since the sweeper's last tick
        counts only up to `_max_tick_gap_s` (a longer one means this loop was not running).
        Before the sweeper's first tick (no loop watching), the plain clock."""
        now = self._clock()
        pending = 0.0
        if self._tick_at is not None:
            pending = max(0.0, now - self._tick_at - self._max_tick_gap_s)
        return now - self.stalled_s - pending

    def tick(self) -> None:
        """The sweeper's heartbeat of its own: records a stall since the last tick."""
        now = self._clock()
        if self._tick_at is not None:
            stall = now - self._tick_at - self._max_tick_gap_s
            if stall > 0:
                self.stalled_s += stall
                if stall >= self.config.heartbeat_interval_s:
                    log.warning("the coordinator's event loop stalled for %.1f s; heartbeat "
                                "silence during it is not held against any worker",
                                stall + self._max_tick_gap_s)
        self._tick_at = now

    # ---- called by the Registry servicer ------------------------------------------------------

    async def claim(self, info: pb.WorkerInfo, identity: str = "") -> pb.RegisterResponse:
        """`register`, after asking a live holder of the id from elsewhere whether it is still
        there: a holder that does not answer its Status probe is declared dead and the
        newcomer registers; one that answers keeps its id (`register` refuses the claim)."""
        holder = self._holder(info, identity)
        if holder is not None and await self._ask_status(holder) is None:
            if self._workers.get(holder.worker_id) is holder and holder.alive:
                self._kill(holder, f"did not answer a Status probe when a worker at "
                                   f"{info.address} registered with its id")
        return self.register(info, identity)

    def register(self, info: pb.WorkerInfo, identity: str = "") -> pb.RegisterResponse:
        """Accept or refuse a registration as it stands: a live id held from elsewhere is
        refused here (`claim` probes the holder first)."""
        reason = self._refusal(info)
        holder = None if reason else self._holder(info, identity)
        if holder is not None:
            reason = (f"worker id {info.worker_id!r} is in use by the live worker at "
                      f"{holder.address}; give this worker another --worker-id")
            self.config.cluster_auth.refused.add(REGISTER_METHOD, reason)
        if reason:
            log.warning("refused worker %r at %s: %s", info.worker_id, info.address, reason)
            return pb.RegisterResponse(accepted=False, reason=reason)
        old = self._workers.get(info.worker_id)
        # Always a fresh channel: a worker registers again after it was declared dead or was
        # restarted (often at the same address); the old channel may sit in gRPC's reconnect
        # backoff after the old process died, failing the first calls with UNAVAILABLE.
        channel = self.config.cluster_auth.aio_channel(info.address)
        if old is not None:
            _close_later(old.channel)
        record = WorkerRecord(
            worker_id=info.worker_id, role=info.role, address=info.address,
            kv_endpoint=info.kv_endpoint, kv_backend=info.kv_backend,
            model_fingerprint=info.model_fingerprint,
            kv_layout_fingerprint=info.kv_layout_fingerprint, channel=channel,
            load=load_from_status(info.status), last_heartbeat=self.responsive_now(),
            registrations=old.registrations + 1 if old else 1, kv=kv_from_status(info.status),
            spec=spec_from_status(info.status),
            refused=refused_from_status(info.status),
            resident=not info.status.unloaded, identity=identity,
        )
        if info.role == "prefill":
            record.prefill_stub = pb_grpc.PrefillWorkerStub(channel)
        else:
            record.decode_stub = pb_grpc.DecodeWorkerStub(channel)
        self._workers[info.worker_id] = record
        log.info("worker %s (%s) at %s registered%s", info.worker_id, info.role, info.address,
                 " again" if old else "")
        self._notify()
        return pb.RegisterResponse(accepted=True,
                                   heartbeat_interval_s=self.config.heartbeat_interval_s)

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        record = self._workers.get(request.worker_id)
        if record is None or not self._check_alive(record):
            return pb.HeartbeatResponse(known=False)  # the worker registers again
        record.last_heartbeat = self.responsive_now()
        if request.HasField("status"):
            record.load = load_from_status(request.status)
            record.new_status()
            record.kv = kv_from_status(request.status)
            record.spec = spec_from_status(request.status)
            record.refused = refused_from_status(request.status)
            record.resident = not request.status.unloaded
        self._notify()
        return pb.HeartbeatResponse(known=True)

    def _holder(self, info: pb.WorkerInfo, identity: str) -> WorkerRecord | None:
        """The live record `info`'s id belongs to, if it is another worker's: registered from
        another address or (under TLS) with another certificate identity."""
        record = self._workers.get(info.worker_id)
        if record is None or not self._check_alive(record):
            return None
        if record.address == info.address and record.identity == identity:
            return None  # the same worker registering again (e.g. after a wrong death verdict)
        return record

    def _refusal(self, info: pb.WorkerInfo) -> str:
        if not info.worker_id:
            return "worker_id is empty"
        if info.role not in ROLES:
            return f"role {info.role!r} is not one of {', '.join(ROLES)}"
        if not info.address:
            return "address is empty"
        if info.model_fingerprint not in self.model_fingerprints:
            served = ", ".join(repr(f) for f in sorted(self.model_fingerprints))
            return (f"model fingerprint {info.model_fingerprint!r} does not match the "
                    f"coordinator's {served}: the worker serves a different model or a "
                    "different file of it")
        # Refuse at registration, not at the first request: a worker whose KV layout differs
        # from the live workers' of its model on the same backend could never pair with them
        # (workers of different models never pair, whatever their layouts).
        layouts = {r.kv_layout_fingerprint for r in self._workers.values()
                   if r.alive and r.worker_id != info.worker_id and r.kv_backend == info.kv_backend
                   and r.model_fingerprint == info.model_fingerprint}
        if layouts and info.kv_layout_fingerprint not in layouts:
            return (f"KV layout fingerprint {info.kv_layout_fingerprint!r} differs from the live "
                    f"workers' ({', '.join(sorted(layouts))}): prefill and decode could not pair")
        return ""

    # ---- liveness -------------------------------------------------------------------------------

    def _check_alive(self, record: WorkerRecord) -> bool:
        silence = self.responsive_now() - record.last_heartbeat
        if record.alive and silence > self.config.heartbeat_deadline_s:
            self._kill(record, f"no heartbeat for {self.config.heartbeat_deadline_s:g} s")
            # Silent through the deadline and the Status probe: frozen (stopped, hung), or cut
            # off. Its open calls would otherwise wait out their timeouts and then fail; ended
            # now (asyncio.CancelledError in each caller: coordinator/call_cancelled.py), each
            # request moves as from a worker that died (request_flow.py), an embedding tries
            # another worker (service.py).
            # The worker gets a fresh channel if it registers again.
            _close_now(record.channel)
        return record.alive

    def sweep(self) -> None:
        """Mark workers whose heartbeats stopped as dead. Run periodically by `run_sweeper`."""
        for record in list(self._workers.values()):
            self._check_alive(record)

    async def run_sweeper(self) -> None:
        self.tick()
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s / 2)
            self.tick()
            self.sweep()
            self._probe_quiet()

    def _probe_quiet(self) -> None:
        """A live worker silent for half its deadline is asked for its Status directly: a
        worker whose heartbeats are lost or late (its registration channel, not its server)
        stays routable while it answers; one that does not is declared dead at the deadline
        as before. At most one probe per worker at a time, each with a deadline."""
        half = self.config.heartbeat_deadline_s / 2
        now = self.responsive_now()
        for record in self._workers.values():
            if (record.alive and now - record.last_heartbeat > half
                    and record.worker_id not in self._probing):
                self._probing.add(record.worker_id)
                asyncio.get_running_loop().create_task(self._probe(record))

    async def _ask_status(self, record: WorkerRecord) -> pb.WorkerStatus | None:
        """The worker's Status, or None when it does not answer within the probe deadline."""
        stub = record.prefill_stub or record.decode_stub
        try:
            return await stub.Status(pb.StatusRequest(),
                                     timeout=min(self.config.control_timeout_s,
                                                 self.config.heartbeat_deadline_s / 2))
        except grpc.aio.AioRpcError as exc:
            log.info("worker %s at %s did not answer a Status probe: %s", record.worker_id,
                     record.address, exc.code().name)
            return None
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            return None  # its channel closed under the probe (declared dead meanwhile)

    async def _probe(self, record: WorkerRecord) -> None:
        try:
            status = await self._ask_status(record)
        finally:
            self._probing.discard(record.worker_id)
        if status is None:
            return
        if self._workers.get(record.worker_id) is record and record.alive:
            record.last_heartbeat = self.responsive_now()
            record.load = load_from_status(status)
            record.new_status()
            record.kv = kv_from_status(status)
            record.spec = spec_from_status(status)
            record.refused = refused_from_status(status)
            self.probes_answered += 1
            self._notify()

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """An RPC to the worker failed as if it were gone (UNAVAILABLE)."""
        record = self._workers.get(worker_id)
        if record is not None and record.alive:
            self._kill(record, reason)

    def _kill(self, record: WorkerRecord, reason: str) -> None:
        record.alive = False
        record.dead_reason = reason
        log.warning("worker %s (%s) at %s is dead: %s", record.worker_id, record.role,
                    record.address, reason)
        self._notify()

    # ---- queries --------------------------------------------------------------------------------

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def assign(self, record: WorkerRecord, requests: int = 0, prefill_tokens: int = 0) -> None:
        """Add to (or, negative, take from) what this coordinator has sent the worker of
        `record`, the record the request was placed on. Nothing once a re-registration has
        replaced it: the new record starts from zero and holds only what was sent to it, so a
        request sent to the old one never takes from the new one's counts."""
        if self._workers.get(record.worker_id) is record:
            record.assigned_requests = max(0, record.assigned_requests + requests)
            record.assigned_prefill_tokens = max(0, record.assigned_prefill_tokens + prefill_tokens)

    def release(self, record: WorkerRecord, blocks: int) -> None:
        """A request of this coordinator that a status of `record` counted ended there holding
        `blocks` KV blocks: the worker frees them now, its last status still counts them (and
        the request running) until its next one, and placement reads them as freed
        (heartbeats are a second apart, longer than a short request lives). Nothing for a
        record replaced meanwhile (a re-registration: its status never counted them)."""
        if self._workers.get(record.worker_id) is record:
            record.released_blocks += blocks
            record.released_requests += 1

    def live(self, roles: tuple[str, ...] = ROLES, model: str | None = None) -> list[WorkerRecord]:
        """Live workers of `roles`; of the model with fingerprint `model` only, when given."""
        return [r for r in self._workers.values() if r.role in roles
                and (model is None or r.model_fingerprint == model) and self._check_alive(r)]

    def snapshots(self, roles: tuple[str, ...] = ROLES,
                  model: str | None = None) -> list[WorkerSnapshot]:
        return [r.snapshot() for r in self.live(roles, model)]

    def all(self, model: str | None = None) -> list[WorkerRecord]:
        self.sweep()
        return [r for r in self._workers.values() if model is None or r.model_fingerprint == model]

    def live_counts(self, model: str | None = None) -> dict[str, int]:
        counts = dict.fromkeys(ROLES, 0)
        for record in self.live(model=model):
            counts[record.role] += 1
        return counts

    # ---- models added and removed at run time (coordinator/on_demand.py) ------------------------

    def add_model(self, fingerprint: str) -> None:
        """Workers of this model are accepted from now on (a model loaded on request)."""
        self.model_fingerprints = self.model_fingerprints | {fingerprint}

    def remove_model(self, fingerprint: str) -> list[str]:
        """Refuse this model's workers again and forget their records (its workers were
        stopped): a worker id of the model may be reused by its next load. The ids dropped."""
        self.model_fingerprints = self.model_fingerprints - {fingerprint}
        dropped = [r for r in self._workers.values() if r.model_fingerprint == fingerprint]
        for record in dropped:
            del self._workers[record.worker_id]
            record.alive, record.dead_reason = False, "its model was unloaded"
            _close_later(record.channel)
        if dropped:
            self._notify()
        return [r.worker_id for r in dropped]

    def view(self, model: str) -> RegistryView:
        """The workers of one served model, with the queries placement, the request flow and
        keep_alive use: what they see of the registry never holds another model's worker."""
        if model not in self.model_fingerprints:
            raise ValueError(f"model fingerprint {model!r} is not served by this registry")
        return RegistryView(self, model)

    # ---- change notification (admission wakes its waiters) --------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self) -> None:
        for listener in self._listeners:
            listener()

    async def close(self) -> None:
        for record in self._workers.values():
            await record.channel.close()
        self._workers.clear()


class RegistryView:
    """One served model's part of a WorkerRegistry (WorkerRegistry.view): the same queries,
    filtered by the model's fingerprint, so that a request is only ever placed on, migrated to,
    loaded or unloaded on workers of its own model. Updates (assign, mark_dead) go to the
    registry; a worker id of another model is not found here."""

    def __init__(self, registry: WorkerRegistry, model_fingerprint: str) -> None:
        self.registry = registry
        self.model_fingerprint = model_fingerprint
        self.config = registry.config

    def get(self, worker_id: str) -> WorkerRecord | None:
        record = self.registry.get(worker_id)
        return record if record is not None and record.model_fingerprint == self.model_fingerprint else None

    def assign(self, record: WorkerRecord, requests: int = 0, prefill_tokens: int = 0) -> None:
        if self.get(record.worker_id) is not None:
            self.registry.assign(record, requests, prefill_tokens)

    def release(self, record: WorkerRecord, blocks: int) -> None:
        if self.get(record.worker_id) is not None:
            self.registry.release(record, blocks)

    def mark_dead(self, worker_id: str, reason: str) -> None:
        if self.get(worker_id) is not None:
            self.registry.mark_dead(worker_id, reason)

    def live(self, roles: tuple[str, ...] = ROLES) -> list[WorkerRecord]:
        return self.registry.live(roles, self.model_fingerprint)

    def snapshots(self, roles: tuple[str, ...] = ROLES) -> list[WorkerSnapshot]:
        return self.registry.snapshots(roles, self.model_fingerprint)

    def all(self) -> list[WorkerRecord]:
        return self.registry.all(self.model_fingerprint)

    def live_counts(self) -> dict[str, int]:
        return self.registry.live_counts(self.model_fingerprint)

    def add_listener(self, listener: Callable[[], None]) -> None:
        self.registry.add_listener(listener)


def _close_later(channel: grpc.aio.Channel) -> None:
    # The replaced record's in-flight calls end with CANCELLED, which their flows report.
    asyncio.get_running_loop().create_task(channel.close(grace=5.0))


def _close_now(channel: grpc.aio.Channel) -> None:
    # No grace: a silent worker answers none of its calls; each ends with CANCELLED at once.
    asyncio.get_running_loop().create_task(channel.close())


def _peer_identity(context) -> str:
    """The caller's certificate identity (its SANs or CN, as gRPC reports them); "" without TLS."""
    identities = context.peer_identities() or ()
    return ",".join(i.decode(errors="replace") for i in identities)


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    async def Register(self, request: pb.WorkerInfo, context) -> pb.RegisterResponse:
        auth = self._registry.config.cluster_auth
        if auth.secret:  # the worker checks that we hold the secret too (common/cluster_auth.py)
            proof = auth.proof(REGISTER_REPLY, body=request_bytes(request))
            context.set_trailing_metadata(((PROOF_HEADER, proof),))
        return await self._registry.claim(request, _peer_identity(context))

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        return self._registry.heartbeat(request)


async def start_registry_server(registry: WorkerRegistry, host: str, port: int
                                ) -> tuple[grpc.aio.Server, int]:
    """Serve the Registry service on host:port (0 = a free port); returns (server, bound port).
    With a cluster secret, Register and Heartbeat without the worker's proof of it end
    UNAUTHENTICATED (the worker exits); with TLS files, only mutual TLS connects."""
    auth = registry.config.cluster_auth
    server = new_server(interceptors=auth.server_interceptors())
    pb_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), server)
    bound = bind(lambda address: auth.add_port(server, address), f"{host}:{port}",
                 "the Registry (where workers register)")
    await server.start()
    return server, bound
