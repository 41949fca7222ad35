"""Serve the coordinator: one `Coordinator` with its three transports around it, on one uvloop
event loop. The HTTP app (uvicorn + FastAPI) owns the life cycle: its lifespan starts and stops
the `Transports`.

    start:  Registry gRPC server (workers register)  ->  background tasks (sweeper, residency)
            ->  client gRPC API  ->  the coordinator learns its ports (listening)
    stop:   client gRPC API  ->  background tasks  ->  Registry gRPC server  ->  registry.close()

SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting, finishes open responses (up to
`graceful_timeout_s`), then the lifespan's exit stops the rest in the order above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc
import uvicorn
from fastapi import FastAPI

from coordinator.config import CoordinatorConfig
from coordinator.connection_limits import protocol_for
from coordinator.grpc_api import start_client_api
from coordinator.http_api import create_app
from coordinator.model import ServedModel
from coordinator.model_catalog import ModelCatalog
from coordinator.registry import start_registry_server
from coordinator.service import Coordinator
from common.model_store import ModelStore
from common.malloc_policy import freeze_loaded_heap

log = logging.getLogger(__name__)


class Transports:
    """The two gRPC servers around one Coordinator, started and stopped in order."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self._registry_server: grpc.aio.Server | None = None
        self._client_server: grpc.aio.Server | None = None

    async def start(self) -> None:
        c, config = self.coordinator, self.coordinator.config
        self._registry_server, registry_port = await start_registry_server(
            c.registry, config.registry_host, config.registry_port)
        await c.start()
        log.info("registry listening on %s:%d", config.registry_host, registry_port)
        self._client_server, grpc_port = await start_client_api(
            c, config.grpc_host, config.grpc_port)
        log.info("gRPC client API (tandem.v1.Tandem, health, reflection) on %s:%d",
                 config.grpc_host, grpc_port)
        c.listening(registry_port, grpc_port)

    async def stop(self) -> None:
        if self._client_server is not None:
            await self._client_server.stop(grace=1.0)
        await self.coordinator.stop()
        if self._registry_server is not None:
            await self._registry_server.stop(grace=1.0)
        await self.coordinator.registry.close()


def build_app(coordinator: Coordinator) -> FastAPI:
    """The HTTP app with a lifespan that starts and stops the coordinator's Transports."""
    transports = Transports(coordinator)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await transports.start()
        log.info("tandem coordinator serving %s on %s://%s:%d (registry port %d)",
                 ", ".join(m.listed_name for m in coordinator.models), "https" if coordinator.config.api_tls else "http",
                 coordinator.config.host, coordinator.config.port, coordinator.registry_port)
        try:
            yield
        finally:
            await transports.stop()

    return create_app(coordinator, lifespan=lifespan)


def uvicorn_server(coordinator: Coordinator, loop: str = "uvloop",
                   graceful_timeout_s: float = 10.0) -> uvicorn.Server:
    config = coordinator.config
    tls = config.api_tls.uvicorn_options() if config.api_tls else {}
    return uvicorn.Server(uvicorn.Config(
        build_app(coordinator), host=config.host, port=config.port, loop=loop,
        # timeouts and connection counts (coordinator/connection_limits.py)
        http=protocol_for(config), timeout_keep_alive=config.idle_timeout_s,
        # log_config=None: uvicorn's loggers go through the root handler that
        # common/log_format.py set (one format, JSON included); its access log is off, as
        # coordinator/access_log.py writes ours (with the request id and the duration).
        lifespan="on", log_level="info", log_config=None, access_log=False,
        timeout_graceful_shutdown=graceful_timeout_s, **tls))


def serve(config: CoordinatorConfig, models: ServedModel | ModelCatalog | list[ServedModel],
          store: ModelStore | None = None,
          attach: Callable[[Coordinator], None] | None = None) -> None:
    """Blocks until SIGINT/SIGTERM. models: the first is the default. `store`: the model
    store the model routes manage. `attach`: called with the Coordinator before it serves
    (models loaded on request attach there: coordinator/on_demand.py)."""
    coordinator = Coordinator(config, models, store)
    if attach is not None:
        attach(coordinator)
    server = uvicorn_server(coordinator)
    # What is loaded by now (FastAPI, the tokenizers, the templates) lives as long as the
    # process: no full collection walks it again (common/malloc_policy.py).
    log.info("%d loaded objects frozen out of the cyclic GC", freeze_loaded_heap())
    server.run()
