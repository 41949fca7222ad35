"""/internal/workers behind the cluster proof (coordinator/ops_routes.py, common/internal_http.py):
with a secret the peer's address counts for nothing, so a reverse proxy on the coordinator's own
host (here a tiny asyncio TCP forwarder) does not open it; a replayed proof does not either; each
refusal shows on /metrics, which needs no API key (vLLM's choice)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from common.cluster_auth import PROOF_HEADER, ClusterAuth
from common.internal_http import WORKERS_PATH, get_internal, internal_headers
from tests.helpers.coordinator_fakes import DEADLINE_S, coordinator_harness, load_model, make_tiny_model_dir, run

SECRET = "s3cret-for-the-internal-routes-test"
KEY = "sk-internal-routes"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _forwarder(port: int) -> asyncio.Server:
    """A same-host reverse proxy: every connection it accepts is the coordinator's, from 127.0.0.1."""
    async def handle(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _refused(metrics: str, reason: str) -> float:
    for line in metrics.splitlines():
        if (line.startswith("tandem_grpc_refused_calls_total{") and f'reason="{reason}"' in line
                and 'method="GET /internal/workers"' in line and 'process="coordinator"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_internal_workers_needs_the_cluster_proof_even_through_a_local_proxy(model):
    async def scenario():
        auth = ClusterAuth(SECRET.encode())
        async with coordinator_harness(model, api_key=KEY, cluster_auth=auth) as h:
            port = int(h.url.rsplit(":", 1)[1])
            proxy = await _forwarder(port)
            proxied = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
            async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
                direct = await c.get(h.url + WORKERS_PATH)
                through = await c.get(proxied + WORKERS_PATH)
                wrong = await c.get(proxied + WORKERS_PATH, headers=internal_headers("another-secret-entirely"))
                headers = internal_headers(SECRET)
                proven = await c.get(proxied + WORKERS_PATH, headers=headers)
                replayed = await c.get(h.url + WORKERS_PATH, headers=headers)
                metrics = await c.get(h.url + "/metrics")  # no API key
                api = await c.get(h.url + "/api/tags")  # the API routes keep theirs
            report = await asyncio.to_thread(get_internal, h.url, SECRET)
            proxy.close()
            await proxy.wait_closed()
            return direct, through, wrong, proven, replayed, metrics, api, report

    direct, through, wrong, proven, replayed, metrics, api, report = run(scenario())
    assert direct.status_code == through.status_code == wrong.status_code == 403
    assert PROOF_HEADER in through.json()["error"] and "no cluster proof" in through.json()["error"]
    assert "wrong cluster proof" in wrong.json()["error"]
    assert proven.status_code == 200 and "workers" in proven.json()  # the proxy is no obstacle
    assert replayed.status_code == 403 and "replayed" in replayed.json()["error"]
    assert "workers" in report and "live" in report
    assert metrics.status_code == 200 and api.status_code == 401
    assert _refused(metrics.text, "no_proof") == 2
    assert _refused(metrics.text, "wrong_secret") == 1
    assert _refused(metrics.text, "replayed") == 1


def test_without_a_secret_the_route_stays_for_clients_on_this_host(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
                return await c.get(h.url + WORKERS_PATH)

    assert run(scenario()).status_code == 200
    assert internal_headers(None) == {} and internal_headers("") == {}
    assert re.fullmatch(r"\d+\.[0-9a-f]{16}\.[0-9a-f]{64}\.[0-9a-f]{64}", internal_headers(SECRET)[PROOF_HEADER])
