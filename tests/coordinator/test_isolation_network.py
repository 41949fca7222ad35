"""One client never stalls or exposes another at the network level (issue 26): sockets that
send nothing, half a header or half a body are closed, one client address cannot hold every
connection, a page on another domain cannot reach the API by rebinding its name to this host,
a gRPC port is never shared silently with a second process, and what one request names (a
keep_alive, a path to create from) cannot break the answers of others or probe the host. Against the real
coordinator (uvicorn + gRPC) with fake workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
    assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == ["tiny:latest"]


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


# ---- connections that hold a socket without a request ------------------------------------------

SHORT = dict(header_timeout_s=0.5, body_timeout_s=0.5, idle_timeout_s=0.5)
CLOSED_WITHIN_S = 10.0  # against a hang only: the timeouts above are 0.5 s


async def _connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (else a timeout)."""
    async def drain() -> bytes:
        data = b""
        while chunk := await reader.read(65536):
            data += chunk
        return data
    return await asyncio.wait_for(drain(), CLOSED_WITHIN_S)


def _head(method: str, path: str, port: int, body_length: int | None = None) -> bytes:
    length = f"Content-Type: application/json\r\nContent-Length: {body_length}\r\n" if (
        body_length is not None) else ""
    return f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{length}\r\n".encode()


def test_idle_and_half_open_sockets_are_closed_after_their_timeout(model, caplog):
    tokens = model.tokenizer.encode("Hello world!", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(model, **SHORT) as h:
            # tokens every 0.3 s: the stream outlasts every timeout and must not be cut
            await h.add_worker("c1", "colocated", Script(tokens=tokens, token_delay_s=0.3))
            port = h.coordinator.config.port
            sends = {
                "nothing": b"",
                "half_a_header": b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: ",
                "half_a_body": _head("POST", "/api/chat", port, 1000) + b'{"model": "tiny", ',
                "idle_after_a_request": _head("GET", "/api/version", port),
            }
            streams = {}
            for name, data in sends.items():
                streams[name] = await _connect(port)
                streams[name][1].write(data)
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                chat = await c.post("/api/chat", json={"model": "tiny", "messages": MESSAGES,
                                                       "stream": False})
            received = {name: await _read_until_closed(reader)
                        for name, (reader, _) in streams.items()}
            for _, writer in streams.values():
                writer.close()
            return received, chat

    with caplog.at_level(logging.INFO):
        received, chat = run(scenario())
    # closed by the server (EOF), having answered nothing to what never became a request
    assert received["nothing"] == b"" and received["half_a_header"] == b""
    assert b"200 OK" not in received["half_a_body"]
    assert received["idle_after_a_request"].startswith(b"HTTP/1.1 200 OK")
    assert chat.status_code == 200 and chat.json()["message"]["content"] == "Hello world!"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_address_past_its_cap_is_refused_while_others_are_served(model):
    async def scenario():
        async with coordinator_harness(model, max_connections_per_client=3) as h:
            port = h.coordinator.config.port
            idle = [await _connect(port) for _ in range(3)]
            flood = [await _connect(port) for _ in range(20)]
            refused = []
            for reader, writer in flood:
                writer.write(_head("GET", "/api/version", port))
                refused.append(await _read_until_closed(reader))
            other = await _connect(port, "127.0.0.2")  # another client address
            other[1].write(_head("GET", "/api/version", port))
            served = await asyncio.wait_for(other[0].readuntil(b"}"), CLOSED_WITHIN_S)
            for _, writer in (*idle, *flood, other):
                writer.close()
            # the idle ones gone, the address is served again (once the server saw them close)
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                deadline = asyncio.get_running_loop().time() + CLOSED_WITHIN_S
                while (again := await c.get("/api/version")).status_code == 503:
                    assert asyncio.get_running_loop().time() < deadline, again.text
                    await asyncio.sleep(0.05)
            return refused, served, again

    refused, served, again = run(scenario())
    for answer in refused:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert "max_connections_per_client" in json.loads(body)["error"]
    assert served.startswith(b"HTTP/1.1 200 OK") and b'"version"' in served
    assert again.status_code == 200


def test_past_max_connections_every_address_is_refused(model):
    async def scenario():
        async with coordinator_harness(model, max_connections=4) as h:
            port = h.coordinator.config.port
            held = [await _connect(port, f"127.0.0.{i}") for i in range(1, 5)]
            reader, writer = await _connect(port, "127.0.0.9")
            writer.write(_head("GET", "/api/version", port))
            refused = await _read_until_closed(reader)
            for _, w in (*held, (reader, writer)):
                w.close()
            return refused

    refused = run(scenario())
    assert refused.startswith(b"HTTP/1.1 503") and b"max_connections" in refused


def test_connection_limits_must_be_positive():
    for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "max_connections",
                 "max_connections_per_client"):
        with pytest.raises(ValueError, match=name):
            CoordinatorConfig(**{name: 0})


def test_a_model_name_is_never_looked_up_as_a_path_of_the_server(model, tmp_path, monkeypatch):
    (tmp_path / "present.gguf").write_bytes(b"not a model")
    monkeypatch.chdir(tmp_path)  # the server's working directory holds present.gguf

    async def scenario():
        async with coordinator_harness(model, ModelStore(tmp_path / "home")) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                answers = {}
                for source in ("present.gguf", "missing.gguf"):
                    answers[source] = (
                        await c.post("/api/create", json={"model": "mine", "from": source,
                                                          "stream": False}),
                        await c.post("/api/copy", json={"source": source,
                                                        "destination": "mine"}))
                return answers

    answers = run(scenario())
    for present, missing in zip(answers["present.gguf"], answers["missing.gguf"]):
        assert present.status_code == missing.status_code == 404
        assert present.json()["error"].replace("present", "missing") == missing.json()["error"]
