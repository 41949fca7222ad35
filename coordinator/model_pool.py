"""One served model's share of the coordinator: its workers (a view of the registry by model
fingerprint), its admission queue, request flow and keep_alive residency.

Everything a request does after its model is known goes through its model's pool, so a
request is placed, queued, migrated, loaded and unloaded among that model's workers only: a
prefill worker of model A never pairs with a decode worker of model B, and one model's full
workers never hold another's requests in the queue. What stays shared across models is the
coordinator's own: the registry (one gRPC service), max_streams, metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.admission import Admission
from coordinator.config import CoordinatorConfig
from coordinator.placement import concurrency_limit
from coordinator.registry import DECODE_ROLES, RegistryView, WorkerRegistry
from coordinator.request_flow import RequestFlow
from coordinator.residency import Residency


class ModelPool:
    def __init__(self, registry: WorkerRegistry, fingerprint: str,
                 config: CoordinatorConfig, on_expire: Callable[[], None] | None = None) -> None:
        """on_expire: how keep_alive unloads a model loaded on request (its workers are
        stopped: coordinator/on_demand.py); None: SetResident on its workers."""
        self.fingerprint = fingerprint
        # Set once its workers are being stopped (a model loaded on request, unloaded): a
        # request holding this pool looks its model up again. Never cleared.
        self.retired = False
        self.workers: RegistryView = registry.view(fingerprint)
        self.admission = Admission(self._capacity, config.max_queue, config.queue_timeout_s,
                                   config.retry_after_s)
        self._registry = registry
        registry.add_listener(self.admission.wake)
        self.flow = RequestFlow(self.workers, config)
        # keep_alive: loads the model on its workers before a request, drops it after expiry.
        self.residency = Residency(self.workers, config.keep_alive_s, config.prefill_timeout_s,
                                   on_expire=on_expire)

    def _capacity(self) -> int:
        return concurrency_limit(self.workers.snapshots(DECODE_ROLES),
                                 self.workers.config.max_running_per_worker)

    def has_decode_worker(self) -> bool:
        return bool(self.workers.live(DECODE_ROLES))

    def retire(self) -> None:
        """Its workers are being stopped: no request starts here again (see `retired`)."""
        self.retired = True
        self._registry.remove_listener(self.admission.wake)
        self.admission.wake()  # queued requests look again, and find the pool retired
