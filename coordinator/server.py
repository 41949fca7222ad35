"""Serve the coordinator: HTTP (uvicorn + FastAPI) and the Registry gRPC service on one uvloop
event loop. SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting, finishes open
responses (up to `graceful_timeout_s`), then the lifespan's exit stops the Registry server.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI

from coordinator.config import CoordinatorConfig
from coordinator.http_api import create_app
from coordinator.model import ServedModel
from coordinator.service import Coordinator
from common.model_store import ModelStore

log = logging.getLogger(__name__)


def build_app(coordinator: Coordinator) -> FastAPI:
    """The app with a lifespan that starts and stops the coordinator's Registry server."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await coordinator.start()
        log.info("tandem coordinator serving %s on %s://%s:%d (registry port %d)",
                 coordinator.model.name, "https" if coordinator.config.api_tls else "http",
                 coordinator.config.host, coordinator.config.port, coordinator.registry_port)
        try:
            yield
        finally:
            await coordinator.stop()

    return create_app(coordinator, lifespan=lifespan)


def uvicorn_server(coordinator: Coordinator, loop: str = "uvloop",
                   graceful_timeout_s: float = 10.0) -> uvicorn.Server:
    config = coordinator.config
    tls = config.api_tls.uvicorn_options() if config.api_tls else {}
    return uvicorn.Server(uvicorn.Config(
        build_app(coordinator), host=config.host, port=config.port, loop=loop,
        lifespan="on", log_level="info", access_log=False,
        timeout_graceful_shutdown=graceful_timeout_s, **tls))


def serve(config: CoordinatorConfig, model: ServedModel, store: ModelStore | None = None) -> None:
    """Blocks until SIGINT/SIGTERM. `store`: the model store the model routes manage."""
    uvicorn_server(Coordinator(config, model, store)).run()
