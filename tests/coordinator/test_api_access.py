"""What real clients reach for beyond generation: the API key (HTTP Bearer, gRPC metadata),
browser origins (CORS as Ollama's OLLAMA_ORIGINS), errors in each API's own shape on every
route, /api/version, and the OpenAI fields tandem maps (vLLM's top_k, min_p,
repetition_penalty) or refuses by name. Real `ollama`, `openai` and gRPC clients; fake workers.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import ollama
import openai
import pytest

from coordinator.access import OLLAMA_DEFAULT_ORIGINS, Origins
from coordinator.client import TandemClient
from coordinator.ollama_routes import OLLAMA_API_VERSION, tandem_version
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run,
)

KEY = "sk-tandem-test-key"
TEXT = "Hello world!"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(autouse=True)
def no_client_key(monkeypatch):
    # The ollama client sends $OLLAMA_API_KEY when no Authorization header is given.
    monkeypatch.delenv("OLLAMA_API_KEY", raising=False)


def oai(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, timeout=DEADLINE_S,
                              max_retries=0)


# ---- API key -------------------------------------------------------------------------------------

def test_api_key_on_the_ollama_api_with_the_ollama_client(model, tokens):
    async def scenario():
        async with coordinator_harness(model, api_key=KEY) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            refusals = []
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S, headers=headers)
                with pytest.raises(ollama.ResponseError) as info:
                    await client.chat(model="tiny", messages=MESSAGES, stream=False)
                refusals.append(info.value)
            keyed = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S,
                                       headers={"Authorization": f"Bearer {KEY}"})
            answer = await keyed.chat(model="tiny", messages=MESSAGES)
            tags = await keyed.list()
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                raw = await c.get("/api/tags")
                lower = await c.get("/api/tags", headers={"Authorization": f"bearer {KEY}"})
                open_ = [await c.get("/"), await c.head("/"), await c.get("/internal/workers")]
                metrics = await c.get("/metrics")
            return refusals, answer, tags, raw, lower, open_, metrics

    refusals, answer, tags, raw, lower, open_, metrics = run(scenario())
    assert [e.status_code for e in refusals] == [401, 401, 401]
    assert "missing API key" in refusals[0].error
    assert "invalid API key" in refusals[1].error and "invalid API key" in refusals[2].error
    assert "Authorization: Bearer KEY" in refusals[0].error
    assert answer.message.content == TEXT and [m.model for m in tags.models] == ["tiny:latest"]
    assert raw.status_code == 401 and set(raw.json()) == {"error"}  # Ollama's shape
    assert raw.headers["www-authenticate"].startswith("Bearer")
    assert lower.status_code == 200  # the scheme is case-insensitive
    assert [r.status_code for r in open_] == [200, 200, 200]  # health and launchers' poll
    assert metrics.status_code == 200  # Prometheus scrapes without the key, as vLLM serves it


def test_api_key_on_the_openai_api_with_the_openai_client(model, tokens):
    async def scenario():
        async with coordinator_harness(model, api_key=KEY) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            async with oai(h.url, "wrong") as bad:
                with pytest.raises(openai.AuthenticationError) as wrong:
                    await bad.chat.completions.create(model="tiny", messages=MESSAGES)
                with pytest.raises(openai.AuthenticationError) as models:
                    await bad.models.list()
            async with oai(h.url, KEY) as good:
                answer = await good.chat.completions.create(model="tiny", messages=MESSAGES)
                listed = await good.models.list()
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                bare = await c.post("/v1/chat/completions", json={})
            return wrong.value, models.value, answer, listed, bare

    wrong, models, answer, listed, bare = run(scenario())
    assert wrong.status_code == 401 and wrong.code == "invalid_api_key"
    assert "invalid API key" in wrong.message and models.status_code == 401
    assert answer.choices[0].message.content == TEXT and [m.id for m in listed.data] == ["tiny:latest"]
    error = bare.json()["error"]  # OpenAI's nested shape
    assert bare.status_code == 401 and "missing API key" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


def test_api_key_on_the_grpc_api(model, tokens):
    def calls(target: str, key: str | None):
        with TandemClient(target, timeout_s=DEADLINE_S, api_key=key) as client:
            health = client.health()  # open: Kubernetes' grpc probes send no metadata
            try:
                return health, client.generate_text("tiny", "Hi"), [m.name for m in client.list_models()]
            except grpc.RpcError as exc:
                return health, exc.code(), exc.details()

    async def scenario():
        async with coordinator_harness(model, api_key=KEY) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            target = f"127.0.0.1:{h.coordinator.grpc_port}"
            # The sync client runs in a thread: the server lives on this event loop.
            return [await asyncio.to_thread(calls, target, key) for key in (None, "wrong", KEY)]

    missing, wrong, good = run(scenario())
    assert missing[:2] == ("SERVING", grpc.StatusCode.UNAUTHENTICATED)
    assert "missing API key" in missing[2] and "authorization: Bearer KEY" in missing[2]
    assert wrong[1] == grpc.StatusCode.UNAUTHENTICATED and "invalid API key" in wrong[2]
    assert good == ("SERVING", TEXT, ["tiny:latest"])


def test_the_tandem_cli_sends_its_key(model):
    from deploy.remote import Server, ServerError

    async def scenario():
        async with coordinator_harness(model, api_key=KEY) as h:
            def both():
                keyed, bare = Server(h.url, api_key=KEY), Server(h.url)
                with pytest.raises(ServerError, match="missing API key"):
                    bare.tags()
                return keyed.running(), [m["name"] for m in keyed.tags()]

            return await asyncio.to_thread(both)

    assert run(scenario()) == (True, ["tiny:latest"])


def test_without_a_key_every_api_is_open(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return await c.get("/api/tags", headers={"Authorization": "Bearer anything"})

    assert run(scenario()).status_code == 200


def test_the_config_refuses_a_key_no_client_can_send():
    from coordinator.config import CoordinatorConfig

    for bad in ("", "has space", "tab\there", "ключ"):
        with pytest.raises(ValueError, match="visible ASCII") as info:
            CoordinatorConfig(api_key=bad)
        assert bad not in str(info.value) or not bad
    assert KEY not in repr(CoordinatorConfig(api_key=KEY))


# ---- CORS ----------------------------------------------------------------------------------------

def test_default_origins_are_ollamas():
    origins = Origins()
    for allowed in ("http://localhost", "https://localhost:8443", "http://127.0.0.1:5173",
                    "http://0.0.0.0:3000", "app://obsidian.md", "file://", "tauri://localhost",
                    "vscode-webview://1234abcd", "vscode-file://vscode-app"):
        assert origins.allows(allowed), allowed
    for refused in ("http://example.com", "http://localhost.example.com",
                    "http://127.0.0.1.nip.io", "chrome-extension://abc", "null"):
        assert not origins.allows(refused), refused
    extra = Origins(["https://app.example", "chrome-extension://*"])
    assert extra.allows("https://app.example") and extra.allows("chrome-extension://abc")
    assert not extra.allows("https://app.example.evil") and not extra.allows("http://app.example")
    assert Origins(["*"]).allows("https://anything.example")
    assert len(OLLAMA_DEFAULT_ORIGINS) == 17


def preflight(origin: str, path: str = "/api/chat") -> dict:
    return dict(method="OPTIONS", url=path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def test_cors_preflight_and_simple_requests(model):
    async def scenario():
        async with coordinator_harness(model, allowed_origins=("https://app.example",),
                                       api_key=KEY) as h:
            auth = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return {
                    "pre_local": await c.request(**preflight("http://localhost:3000")),
                    "pre_extra": await c.request(**preflight("https://app.example", "/v1/models")),
                    "pre_evil": await c.request(**preflight("https://evil.example")),
                    "get_extra": await c.get("/api/tags", headers={"Origin": "https://app.example", **auth}),
                    "get_evil": await c.get("/api/tags", headers={"Origin": "https://evil.example", **auth}),
                    "v1_evil": await c.get("/v1/models", headers={"Origin": "https://evil.example", **auth}),
                    "no_key": await c.get("/api/tags", headers={"Origin": "http://localhost:5173"}),
                    "no_origin": await c.get("/api/tags", headers=auth),
                }

    r = run(scenario())
    for name, origin in (("pre_local", "http://localhost:3000"), ("pre_extra", "https://app.example")):
        assert r[name].status_code == 200, name
        assert r[name].headers["access-control-allow-origin"] == origin
        assert "POST" in r[name].headers["access-control-allow-methods"]
        assert "authorization" in r[name].headers["access-control-allow-headers"]
    assert r["pre_evil"].status_code == 400
    assert "access-control-allow-origin" not in r["pre_evil"].headers
    assert r["get_extra"].status_code == 200
    assert r["get_extra"].headers["access-control-allow-origin"] == "https://app.example"
    # A page of a site not allowed is refused, as Ollama does, in each API's shape.
    assert r["get_evil"].status_code == 403 and "OLLAMA_ORIGINS" in r["get_evil"].json()["error"]
    assert "access-control-allow-origin" not in r["get_evil"].headers
    assert r["v1_evil"].status_code == 403 and "OLLAMA_ORIGINS" in r["v1_evil"].json()["error"]["message"]
    # An allowed page can read why its request failed.
    assert r["no_key"].status_code == 401
    assert r["no_key"].headers["access-control-allow-origin"] == "http://localhost:5173"
    assert r["no_origin"].status_code == 200 and "access-control-allow-origin" not in r["no_origin"].headers


def test_ollama_origins_star_allows_every_origin(model):
    async def scenario():
        async with coordinator_harness(model, allowed_origins=("*",)) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return (await c.get("/api/tags", headers={"Origin": "https://any.example"}),
                        await c.request(**preflight("https://any.example")))

    simple, pre = run(scenario())
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "*"
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"


# ---- errors in each API's shape, /api/version ----------------------------------------------------

def test_unknown_routes_and_wrong_methods_answer_in_each_apis_shape(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S)
            with pytest.raises(ollama.ResponseError) as push:  # tandem has no /api/push
                await client.push("tiny")
            async with oai(h.url, "x") as o:
                with pytest.raises(openai.NotFoundError) as images:  # nor images
                    await o.images.generate(model="tiny", prompt="a river")
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return push.value, images.value, {
                    "api_404": await c.get("/api/nothing"),
                    "root_404": await c.get("/nothing"),
                    "v1_404": await c.get("/v1/nothing"),
                    "api_405": await c.post("/api/tags"),
                    "chat_405": await c.get("/api/chat"),
                    "v1_405": await c.get("/v1/chat/completions"),
                }

    push, images, r = run(scenario())
    assert push.status_code == 404 and "POST /api/push: no such route" in push.error
    assert images.status_code == 404
    assert images.body["message"] == "POST /v1/images/generations: no such route"
    for name in ("api_404", "root_404", "api_405", "chat_405"):
        assert set(r[name].json()) == {"error"} and isinstance(r[name].json()["error"], str), name
    for name in ("v1_404", "v1_405"):
        error = r[name].json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["type"] == "invalid_request_error"
    assert [r[n].status_code for n in r] == [404, 404, 404, 405, 405, 405]
    assert set(r["api_405"].headers["allow"].split(", ")) == {"GET", "HEAD"}  # HEAD: as Ollama
    assert r["api_405"].json()["error"].startswith("method POST is not allowed on /api/tags "
                                                   "(allowed: ")
    assert "method GET is not allowed" in r["v1_405"].json()["error"]["message"]


def test_api_version_is_the_ollama_api_matched_and_tandems_own_is_beside_it(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            async with httpx.AsyncClient(base_url=h.url, timeout=DEADLINE_S) as c:
                return await c.get("/api/version")

    r = run(scenario())
    assert r.json() == {"version": OLLAMA_API_VERSION, "tandem": tandem_version()}
    assert tuple(int(x) for x in OLLAMA_API_VERSION.split(".")) >= (0, 12, 0)
    assert r.headers["x-tandem-version"] == tandem_version()


# ---- OpenAI fields: mapped or refused by name ----------------------------------------------------

def test_vllm_sampling_fields_reach_the_worker(model, tokens):
    async def requests(client: openai.AsyncOpenAI) -> openai.BadRequestError:
        await client.chat.completions.create(
            model="tiny", messages=MESSAGES,
            extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.3})
        await client.completions.create(model="tiny", prompt="Hi", extra_body={"top_k": -1})
        await client.chat.completions.create(model="tiny", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                 extra_body={"repetition_penalty": 0})
        return bad.value

    async def scenario():
        async with coordinator_harness(model) as h:
            worker = await h.add_worker("c1", "colocated", Script(tokens=tokens))
            async with oai(h.url, "x") as client:
                return worker, await requests(client)

    worker, bad = run(scenario())
    first, minus_one, plain = (r.sampling for r in worker.requests)
    assert (first.top_k, first.min_p, first.repeat_penalty) == (7, pytest.approx(0.05),
                                                                pytest.approx(1.3))
    assert minus_one.top_k == 0  # vLLM's -1: off
    assert (plain.top_k, plain.min_p, plain.repeat_penalty) == (0, 0.0, 1.0)
    assert bad.status_code == 400 and "'repetition_penalty' must be between" in bad.message


@pytest.mark.parametrize("kind,field,value", [
    ("chat", "prompt_logprobs", 1),
    ("chat", "use_beam_search", True),
    ("chat", "guided_whitespace_pattern", " "),
    ("chat", "echo", True),  # completions honour echo (tests/coordinator/test_api_logprobs.py)
    ("completion", "best_of", 3),
    ("completion", "suffix", "tail"),
])
def test_openai_fields_tandem_does_not_honour_are_400_naming_them(model, kind, field, value):
    async def scenario():
        async with coordinator_harness(model) as h, oai(h.url, "x") as client:
            with pytest.raises(openai.BadRequestError) as info:
                if kind == "chat":
                    await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                         extra_body={field: value})
                else:
                    await client.completions.create(model="tiny", prompt="Hi",
                                                    extra_body={field: value})
            return info.value

    error = run(scenario())
    assert error.status_code == 400
    assert error.body["message"].startswith(f"{field} is not supported:")  # names the field


def test_openai_fields_that_ask_for_nothing_are_accepted(model, tokens):
    async def scenario():
        async with coordinator_harness(model) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            async with oai(h.url, "x") as client:
                chat = await client.chat.completions.create(
                    model="tiny", messages=MESSAGES, n=1, logprobs=False, logit_bias={},
                    top_logprobs=0, user="u1",
                    extra_body={"best_of": 1, "ignore_eos": False})
                text = await client.completions.create(model="tiny", prompt="Hi", echo=False,
                                                       best_of=1, suffix="")
                return chat, text

    chat, text = run(scenario())
    assert chat.choices[0].message.content == TEXT and text.choices[0].text == TEXT


def test_ollama_logprobs_out_of_range_are_refused_by_name(model):
    async def scenario():
        async with coordinator_harness(model) as h:
            client = ollama.AsyncClient(host=h.url, timeout=DEADLINE_S)
            errors = []
            for call in (client.chat(model="tiny", messages=MESSAGES, logprobs=True,
                                     top_logprobs=21),
                         client.generate(model="tiny", prompt="Hi", logprobs=True,
                                         top_logprobs=-1)):
                with pytest.raises(ollama.ResponseError) as info:
                    await call
                errors.append(info.value)
            return errors

    chat, generate = run(scenario())
    assert chat.status_code == generate.status_code == 400
    assert chat.error.startswith("top_logprobs must be between 0 and 20")
    assert generate.error.startswith("top_logprobs must be between 0 and 20")
