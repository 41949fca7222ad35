"""One client never stalls or exposes another at the network level (issue 26): a gRPC port is
never shared silently with a second process; and what one request names (a keep_alive, a path
to create from) cannot break the answers of others or probe the host. Against the real
coordinator (uvicorn + gRPC) with fake workers.
"""

from __future__ import annotations

import math

import httpx
import pytest

from common.grpc_server import bind, new_server
from common.model_store import ModelStore
from coordinator.config import MAX_KEEP_ALIVE_S, CoordinatorConfig
from coordinator.grpc_api import start_client_api
from coordinator.model_routes import UNSERVABLE_SOURCE
from coordinator.registry import start_registry_server
from coordinator.residency import KeepAliveError, parse_keep_alive
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run,
)

MESSAGES = [{"role": "user", "content": "Hi"}]


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



# ---- values one request names ------------------------------------------------------------------

def test_a_keep_alive_out_of_range_is_a_400_and_ps_keeps_answering(model):
    tokens = model.tokenizer.encode("Hi!", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                chat = {"model": "tiny", "messages": MESSAGES, "stream": False}
                refused = [await c.post(path, json={**body, "keep_alive": value})
                           for value in (1e12, "99999999999999999999h", "9000h", "1e400")
                           for path, body in (("/api/chat", chat),
                                              ("/api/generate", {"model": "tiny",
                                                                 "prompt": "Hi", "stream": False}))]
                forever = await c.post("/api/chat", json={**chat, "keep_alive": -1})
                year = await c.post("/api/chat", json={**chat, "keep_alive": "8760h"})
                ps = await c.get("/api/ps")
            return refused, forever, year, ps

    refused, forever, year, ps = run(scenario())
    for r in refused:
        assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text
    assert forever.status_code == 200 and year.status_code == 200
    assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == ["tiny"]


def test_keep_alive_bounds():
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-99999999999999h") == math.inf
    assert parse_keep_alive("8760h") == MAX_KEEP_ALIVE_S
    for value in (1e12, "99999999999999999999h", MAX_KEEP_ALIVE_S + 1):
        with pytest.raises(KeepAliveError, match="out of range"):
            parse_keep_alive(value)
    with pytest.raises(ValueError, match="keep_alive_s"):
        CoordinatorConfig(keep_alive_s=1e12)


def test_create_from_a_path_says_the_same_for_every_path_it_cannot_serve(model, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("private")
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(b"GGUF")
    locked.chmod(0)
    sources = [str(notes), str(locked), str(tmp_path), str(tmp_path / "missing.gguf"),
               "/nowhere/at/all.gguf", "~root/model.gguf", "~/model.gguf", "./model.gguf"]

    async def scenario():
        async with coordinator_harness(model, ModelStore(tmp_path / "home")) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return [await c.post("/api/create", json={"model": "mine", "from": source,
                                                          "stream": False})
                        for source in sources]

    answers = run(scenario())
    assert {r.status_code for r in answers} == {400}
    assert {r.json()["error"] for r in answers} == {UNSERVABLE_SOURCE}
    assert all(str(tmp_path) not in r.text for r in answers)


# ---- DNS rebinding: the Host and the Origin ----------------------------------------------------

def test_a_host_that_is_not_the_servers_is_refused_in_each_apis_shape(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            port = h.coordinator.config.port
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                def get(path, host, **headers):
                    return c.get(path, headers={"Host": host, **headers})
                return {
                    "attacker": await get("/api/tags", "attacker.example"),
                    "attacker_port": await get("/api/version", f"attacker.example:{port}"),
                    "attacker_v1": await get("/v1/models", f"attacker.example:{port}"),
                    "attacker_root": await get("/", f"attacker.example:{port}"),
                    # a rebinding page is same-origin in the browser: Origin equals Host
                    "rebound": await get("/api/tags", f"attacker.example:{port}",
                                         Origin=f"http://attacker.example:{port}"),
                    "origin_is_host": await get("/api/tags", f"127.0.0.1:{port}",
                                                Origin=f"http://evil.example:{port}"),
                    "ip": await get("/api/version", f"127.0.0.1:{port}"),
                    "localhost": await get("/api/version", f"localhost:{port}"),
                    "ipv6": await get("/api/version", f"[::1]:{port}"),
                    "sub_localhost": await get("/api/version", f"app.localhost:{port}"),
                    "browser_local": await get("/api/tags", f"localhost:{port}",
                                               Origin=f"http://localhost:{port}"),
                }

    r = run(scenario())
    for name in ("attacker", "attacker_port", "attacker_v1", "attacker_root", "rebound"):
        assert r[name].status_code == 403, (name, r[name].text)
        assert "attacker.example" in r[name].text and "--allowed-hosts" in r[name].text
    assert set(r["attacker"].json()) == {"error"}  # Ollama's shape
    assert r["attacker_v1"].json()["error"]["message"]  # OpenAI's nested shape
    assert r["origin_is_host"].status_code == 403 and "OLLAMA_ORIGINS" in r["origin_is_host"].text
    for name in ("ip", "localhost", "ipv6", "sub_localhost", "browser_local"):
        assert r[name].status_code == 200, (name, r[name].text)


def test_allowed_hosts_names_and_wildcards(model):
    async def scenario():
        async with coordinator_harness(model, allowed_hosts=("tandem.example", "*.lab.example")
                                       ) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                hosts = ("tandem.example", "TANDEM.example.:80", "gpu1.lab.example",
                         "lab.example", "attacker.example")
                plain = [(await c.get("/api/version", headers={"Host": h_})).status_code
                         for h_ in hosts]
        async with coordinator_harness(model, allowed_hosts=("*",)) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                star = (await c.get("/api/version", headers={"Host": "any.example"})).status_code
        return plain, star

    plain, star = run(scenario())
    assert plain == [200, 200, 200, 403, 403] and star == 200
    with pytest.raises(ValueError, match="allowed_hosts"):
        CoordinatorConfig(allowed_hosts=("bad host",))
