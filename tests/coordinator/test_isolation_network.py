"""One client never stalls or exposes another at the network level (issue 26): a gRPC port is
never shared silently with a second process; and what one request names (a keep_alive, a path
to create from) cannot break the answers of others or probe the host. Against the real
coordinator (uvicorn + gRPC) with fake workers.
"""

from __future__ import annotations

import httpx
import pytest

from common.grpc_server import bind, new_server
from coordinator.grpc_api import start_client_api
from coordinator.registry import start_registry_server
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, coordinator_harness, load_model, make_tiny_model_dir, run,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


# ---- gRPC ports are never shared ---------------------------------------------------------------

def test_a_second_grpc_server_on_a_taken_port_fails_naming_the_port(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            c = h.coordinator
            errors = []
            for start, port in ((start_registry_server, c.registry_port),
                                (start_client_api, c.grpc_port)):
                target = c.registry if start is start_registry_server else c
                with pytest.raises(OSError) as info:
                    await start(target, "127.0.0.1", port)
                errors.append((port, str(info.value)))
            # A plain server of ours (worker nodes, the gRPC KV receiver) too.
            other = new_server()
            with pytest.raises(OSError) as info:
                bind(other.add_insecure_port, f"127.0.0.1:{c.grpc_port}", "a worker node")
            errors.append((c.grpc_port, str(info.value)))
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as client:
                still = await client.get("/api/version")
            return errors, still

    errors, still = run(scenario())
    for port, message in errors:
        assert f"127.0.0.1:{port}" in message and "in use" in message
    assert still.status_code == 200

