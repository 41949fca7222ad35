"""Models loaded on request: a request may name a model that is not served yet but that the
stores hold (tandem's, Ollama's, the Hugging Face cache: the resolution `--model` uses); the
coordinator then has the launcher start that model's workers (coordinator/worker_supervisor.py),
waits for them to register, and serves the request there, as Ollama loads a model on its
first request. Within a budget (coordinator/model_budget.py): to make room, the least recently
used model loaded this way with nothing in flight is unloaded first, its workers stopped.

Life of one model, all on the coordinator's event loop:

    get(name)   not in the catalog: one load per model (by name_key), however many requests
                wait for it; each waits shielded, so a client that leaves stops waiting and
                the load goes on (the model then idles until keep_alive unloads it).
    _load       resolve it (off the loop) -> under the budget lock: choose and unload what must
                go, reserve its share -> add its pool (the registry accepts its workers) ->
                supervisor.start -> wait until every worker it started is live, failing at
                the first exit the supervisor reports or after start_timeout_s -> into the
                catalog (/api/ps lists it from here on; /api/tags and /v1/models list every
                model the stores hold, loaded or not: held()).
    unload      keep_alive expiry or 0 (Residency.on_expire), or room for another: the pool is
                retired and the model leaves the catalog at once (synchronously, so no request
                starts there again), then its workers are stopped and the registry forgets
                them; a load of the same model waits for that stop first.

Invariants: a fingerprint is in `_entries` from its reservation until its workers are stopped
(so it counts against the budget the whole time its memory may be held); the models served
from the start are pinned (counted, never unloaded for room or by keep_alive through here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from common.errors import ModelNotFoundError, TandemError
from common.model_name import display_name, name_key
from common.model_store import ModelStore
from common.supervisor_wire import SupervisorError
from coordinator.model import ServedModel, load_from_store, shown
from coordinator.model_budget import Loaded, ModelBudget, model_bytes, shown_bytes
from coordinator.prompts import off_loop
from coordinator.worker_supervisor import WorkerSupervisor

log = logging.getLogger(__name__)


def _stamp(path: Path) -> tuple:
    """What changes when the model at `path` does (a file rewritten, a snapshot's files)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return tuple((str(f), s.st_mtime_ns, s.st_size) for f, s in ((f, f.stat()) for f in files))


class ModelLoadError(TandemError):
    """A model in the store could not be started (its worker exited, or never registered)."""


@dataclass
class _Entry:
    model: ServedModel
    size: int
    pinned: bool
    ready: bool = False  # its workers registered and it is in the catalog


class OnDemandModels:
    def __init__(self, coordinator, supervisor: WorkerSupervisor, budget: ModelBudget,
                 store: ModelStore, start_timeout_s: float = 300.0,
                 poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                 templates: Mapping[str, str] | None = None) -> None:
        """templates: {name_key(model): chat template file} (--chat-template-for): what a
        model loaded on request renders instead of its own."""
        self.coordinator = coordinator  # coordinator/service.py's Coordinator
        self.supervisor = supervisor
        self.budget = budget
        self.store = store
        self.templates = dict(templates or {})
        self.start_timeout_s = start_timeout_s
        self.poll_s = poll_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {
            m.fingerprint: _Entry(m, model_bytes(m.path), pinned=True, ready=True)
            for m in coordinator.models}
        self._loads: dict[str, asyncio.Task[ServedModel]] = {}  # name_key -> its load
        self._stops: dict[str, asyncio.Task[None]] = {}  # fingerprint -> its workers' stop
        self._budget_lock = asyncio.Lock()  # one choice of what to unload at a time
        # name -> (its file's stamp, the model read from it): what /api/tags lists of the
        # stores, read again only when the file changes.
        self._listed: dict[str, tuple[tuple, ServedModel]] = {}
        # A 404 of a route that does not load (/tokenize) says how the model gets served.
        coordinator.models.missing_hint = self._missing_hint

    def _missing_hint(self, name: str) -> str:
        try:
            self.store.resolve(name, paths=False)
        except (TandemError, OSError, ValueError):
            return ""
        return ": it is in the model store and is loaded by its first request (chat, generate)"

    async def start(self) -> None:
        await self.supervisor.open()

    # ---- requests -------------------------------------------------------------------------------

    async def get(self, name: str) -> ServedModel:
        """The model `name` names, loading it first when the stores hold it and it is not
        served; ModelNotFoundError when no store does, ModelBudgetExceeded when it cannot fit."""
        model = self.coordinator.models.find(name)
        if model is not None:
            return model
        key = name_key(name)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.create_task(self._load(canonical_name(name)))
            self._loads[key] = task
            task.add_done_callback(lambda t: self._load_done(key, t))
        return await asyncio.shield(task)

    def _load_done(self, key: str, task: asyncio.Task) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled() and task.exception() is not None:
            log.warning("loading %s failed: %s", key, task.exception())  # also retrieves it

    async def describe(self, name: str) -> ServedModel | None:
        """The model the stores hold under `name`, read (metadata, tokenizer, defaults) but
        not loaded; None when none does. For what a request's body needs before it is checked
        (the model's default options), so a malformed request never starts workers."""
        try:
            return await self._read(name)
        except ModelNotFoundError:
            return None

    async def held(self) -> list[ServedModel]:
        """The models the stores hold that are not loaded, read (not loaded) for the listings
        (/api/tags, /v1/models), as Ollama lists every model of its store: one entry per name,
        none for a file that is served (under any name). A model that cannot be read is left
        out; a request for it names the problem."""
        found: dict[str, ServedModel] = {}
        for name in await off_loop(self.store.held_names):
            if self.coordinator.models.find(name) is not None:
                continue
            model = await self._listed_model(name)
            if (model is not None and model.fingerprint not in self.coordinator.models.fingerprints
                    and model.listed_name not in found):
                found[model.listed_name] = model
        return list(found.values())

    async def _listed_model(self, name: str) -> ServedModel | None:
        try:
            path = await off_loop(self.store.resolve, name, False)
            stamp = await off_loop(_stamp, path)
            cached = self._listed.get(name)
            if cached is not None and cached[0] == stamp:
                return cached[1]
            model = await off_loop(load_from_store, self.store, name, name,
                                   self._template(name), lambda message: None, path)
        except (TandemError, OSError, ValueError) as e:
            log.debug("not listing %s: %s", name, e)
            return None
        self._listed[name] = (stamp, model)
        return model

    async def _read(self, name: str) -> ServedModel:
        try:
            # paths=False: a client's name never probes the server's files.
            path = await off_loop(self.store.resolve, name, False)
        except ModelNotFoundError:
            # As for any name not served: the store's message would show the server's paths.
            raise ModelNotFoundError(f"model '{shown(name)}' not found") from None
        return await off_loop(load_from_store, self.store, name, name, self._template(name),
                              logging.getLogger("coordinator").warning, path)

    def _template(self, name: str) -> str | None:
        return self.templates.get(name_key(name))

    def loaded(self) -> list[str]:
        """Names of the models loaded on request and ready, least recently used first."""
        entries = [e for e in self._entries.values() if e.ready and not e.pinned]
        return [e.model.name for e in sorted(entries, key=self._last_used)]

    # ---- loading --------------------------------------------------------------------------------

    async def _load(self, name: str) -> ServedModel:
        model = await self._read(name)
        fingerprint = model.fingerprint
        served = self.coordinator.models.by_fingerprint(fingerprint) if (
            fingerprint in self.coordinator.models.fingerprints) else None
        if served is not None:  # another name of a served model (its file is served)
            return served
        if fingerprint in self._stops:  # unloading: its workers' ids and memory are in use
            await self._stops[fingerprint]
        size = await off_loop(model_bytes, model.path)
        async with self._budget_lock:
            if fingerprint in self._entries:  # loading under another name right now
                raise ModelLoadError(f"model '{shown(name)}' is being loaded under another "
                                     "name; retry in a moment")
            loaded = [Loaded(fp, e.model.name, e.size, self._last_used(e),
                             evictable=e.ready and not e.pinned and self._idle(fp))
                      for fp, e in self._entries.items()]
            for victim in self.budget.to_unload(model.name, size, loaded):
                log.info("unloading %s (%s) to make room for %s (%s; budget: %s)",
                         victim.name, shown_bytes(victim.size), model.name, shown_bytes(size),
                         self.budget.describe())
                await self._unload(victim.key)
            self._entries[fingerprint] = _Entry(model, size, pinned=False)
        try:
            await self._start(model)
        except BaseException:
            # Never half-loaded: its workers stopped, its reservation dropped.
            self.coordinator.retire_model(fingerprint)
            await asyncio.shield(self._stop_workers(model))
            raise
        self._entries[fingerprint].ready = True
        log.info("model %s loaded on request (%s of weights; loaded on request now: %s)",
                 model.name, shown_bytes(size), ", ".join(self.loaded()))
        return self.coordinator.models.by_fingerprint(fingerprint)

    async def _start(self, model: ServedModel) -> None:
        self.coordinator.add_model_pool(model, on_expire=lambda: self.unload_soon(model.fingerprint))
        started = self._clock()
        try:
            workers = await self.supervisor.start(model.name, model.path)
        except SupervisorError as exc:
            raise ModelLoadError(f"model '{model.name}' could not be started: {exc}") from None
        log.info("started %s for %s; waiting for them to register", ", ".join(workers), model.name)
        registry = self.coordinator.registry
        changed = asyncio.Event()
        listener = changed.set
        registry.add_listener(listener)
        try:
            while True:
                live = {r.worker_id for r in registry.live(model=model.fingerprint)}
                if all(w in live for w in workers):
                    break
                exits = await self.supervisor.exits(model.name)
                if exits:
                    first = exits[0]
                    raise ModelLoadError(f"model '{model.name}' could not be loaded: its worker "
                                         f"{first.worker} exited with code {first.code}; last "
                                         f"lines of its log:\n{first.log_tail}")
                left = started + self.start_timeout_s - self._clock()
                if left <= 0:
                    raise ModelLoadError(
                        f"model '{model.name}': its workers did not all register within "
                        f"{self.start_timeout_s:g} s (live: {', '.join(sorted(live)) or 'none'}; "
                        f"started: {', '.join(workers)})")
                changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(self.poll_s, left))
        finally:
            registry.remove_listener(listener)
        self.coordinator.publish_model(model)

    # ---- unloading ------------------------------------------------------------------------------

    def unload_soon(self, fingerprint: str) -> None:
        """keep_alive expired (or 0) for a model loaded on request: retire it now, stop its
        workers in the background."""
        entry = self._entries.get(fingerprint)
        if entry is None or entry.pinned or fingerprint in self._stops:
            return
        self._retire(fingerprint)

    async def _unload(self, fingerprint: str) -> None:
        self._retire(fingerprint)
        await self._stops[fingerprint]

    def _retire(self, fingerprint: str) -> None:
        entry = self._entries[fingerprint]
        self.coordinator.retire_model(fingerprint)
        task = asyncio.create_task(self._stop_workers(entry.model))
        self._stops[fingerprint] = task

    async def _stop_workers(self, model: ServedModel) -> None:
        try:
            ended = await self.supervisor.stop(model.name)
            log.info("unloaded %s: stopped %s", model.name, ", ".join(ended) or "nothing")
        except (SupervisorError, asyncio.TimeoutError) as exc:
            log.warning("stopping the workers of %s failed: %s", model.name, exc)
        finally:
            self.coordinator.registry.remove_model(model.fingerprint)
            self._entries.pop(model.fingerprint, None)
            self._stops.pop(model.fingerprint, None)

    async def close(self) -> None:
        """Waits for the stops in progress (the launcher stops every worker on its way out)."""
        for task in list(self._stops.values()):
            with contextlib.suppress(Exception):
                await task
        await self.supervisor.close()

    # ---- budget inputs --------------------------------------------------------------------------

    def _idle(self, fingerprint: str) -> bool:
        pool = self.coordinator.pools.get(fingerprint)
        return pool is not None and pool.residency.in_flight == 0

    def _last_used(self, entry: _Entry) -> float:
        pool = self.coordinator.pools.get(entry.model.fingerprint)
        return pool.residency.last_used if pool is not None else self._clock()


def canonical_name(name: str) -> str:
    """The name a model loaded on request is served (and its workers named) by, whichever
    spelling loaded it: Ollama's shortest form without `:latest` (`library/beta:latest` ->
    `beta`, `qwen3:0.6b` stays)."""
    return display_name(name.strip()).removesuffix(":latest")
