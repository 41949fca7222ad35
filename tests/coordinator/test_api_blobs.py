"""/api/blobs/:digest and /api/create with `files`, `template` and `system` (Open WebUI's GGUF
upload), through the real `ollama` client against the real coordinator (fake workers) with a
model store in a temporary home, on a tiny GGUF larger than the JSON body limit."""

from __future__ import annotations

import hashlib

import httpx
import ollama
import pytest

from common.model_store import ModelStore
from coordinator.model import load_from_store, load_served_model
from coordinator.prompts import chat_prompt_ids
from tests.helpers.coordinator_fakes import (
    Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)
from tests.coordinator.test_api_models import in_thread, refusal

MAX_BODY = 64 * 1024  # JSON bodies; the GGUF below is several times larger
TEMPLATE = ("{{ '<|sys|>' + (messages[0]['content'] if messages[0]['role'] == 'system' else '-') }}"
            "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}"
            "{% if tools %}{{ tools | length }}{% endif %}")
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("served")))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from reliability.model_factory import make_tiny_gguf

    path = make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf").path
    assert path.stat().st_size > 4 * MAX_BODY
    return path


def digest_of(path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_blob_upload_then_create_with_files_template_and_system(served, tiny_gguf, tmp_path):
    digest = digest_of(tiny_gguf)

    async def scenario():
        store = ModelStore(tmp_path / "home")
        async with coordinator_harness(served, store=store, max_body_bytes=MAX_BODY) as h:
            c = ollama.Client(host=h.url, timeout=60)
            url = f"{h.url}/api/blobs/{digest}"
            out = {"head_before": (await in_thread(httpx.head, url)).status_code}
            out["upload"] = await in_thread(c.create_blob, tiny_gguf)
            out["head_after"] = (await in_thread(httpx.head, url)).status_code
            out["again"] = (await in_thread(httpx.post, url, content=b"ignored")).status_code
            out["lines"] = await in_thread(lambda: [p.status for p in c.create(
                "uploaded", files={"tiny-f32.gguf": digest}, template=TEMPLATE,
                system="Be brief.", stream=True)])
            out["plain"] = await in_thread(c.create, "plain", files={"t.gguf": digest})
            out["missing"] = await refusal(c.create, "x", files={"t.gguf": "sha256:" + "1" * 64})
            out["two"] = await refusal(c.create, "x", files={"a.gguf": digest, "b.gguf": digest})
            out["safetensors"] = await refusal(c.create, "x",
                                               files={"model.safetensors": digest})
            out["both"] = await refusal(c.create, "x", from_=str(tiny_gguf),
                                        files={"t.gguf": digest})
            out["go_template"] = await refusal(c.create, "x", files={"t.gguf": digest},
                                               template="{{ .Prompt }}")
            out["served_name"] = await refusal(c.create, "tiny", files={"t.gguf": digest})
            return store, out

    store, out = run(scenario())
    assert out["head_before"] == 404
    assert out["upload"] == digest and out["head_after"] == 200 and out["again"] == 200
    assert out["lines"] == ["parsing GGUF", f"using existing layer {digest}",
                            "writing manifest", "success"]
    assert out["plain"].status == "success"
    assert out["missing"].status_code == 400 and "not found: upload it first" in out["missing"].error
    for key in ("two", "safetensors"):
        assert out[key].status_code == 400 and "exactly one .gguf file" in out[key].error
    assert out["both"].status_code == 400 and "either from or files" in out["both"].error
    assert out["go_template"].status_code == 400 and "Ollama Go template" in out["go_template"].error
    assert out["served_name"].status_code == 409

    # Durable: the names resolve to their own links to the blob, with what create kept.
    blob = store.blob_store(1 << 30).path(digest)
    path = store.resolve("uploaded")
    assert path != blob and path.samefile(blob)
    assert {e.name: e.sha256 for e in store.list()} == {"uploaded": digest[7:], "plain": digest[7:]}
    kept = store.overrides("uploaded:latest")
    assert (kept.template, kept.system) == (TEMPLATE, "Be brief.")
    assert store.overrides("plain") == type(kept)()
    # ... so that serving the name renders with them (python -m coordinator --model uploaded),
    # and serving the other name of the same file does not answer to this one.
    model = load_from_store(store, "uploaded", "uploaded")
    assert model.tokenizer.chat_template == TEMPLATE and model.defaults.system == "Be brief."
    assert "plain" not in model.names
    plain = load_from_store(store, "plain", "plain")
    assert plain.defaults.system is None and "uploaded" not in plain.names
    assert plain.tokenizer.chat_template == load_served_model(blob, "b").tokenizer.chat_template
    # The stored system message reaches a chat without one, never one that brings its own
    # (the routes lay the model's defaults under each chat: ModelDefaults.with_system).
    prompt = lambda messages: model.tokenizer.decode(  # noqa: E731
        chat_prompt_ids(model, model.defaults.with_system(messages)))
    assert prompt(MESSAGES).startswith("<|sys|>Be brief.<system>Be brief.<user>Hello there")
    own = [{"role": "system", "content": "Mine."}, *MESSAGES]
    assert "Be brief." not in prompt(own) and prompt(own).startswith("<|sys|>Mine.")
    store.delete("uploaded")
    assert blob.is_file() and store.resolve("plain").samefile(blob)


def test_blob_uploads_are_verified_bounded_and_need_the_key(served, tmp_path):
    body = b"GGUF" + bytes(range(256)) * 1024  # 256 KiB, past the JSON body limit
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    key = {"Authorization": "Bearer secret"}

    async def scenario():
        store = ModelStore(tmp_path / "home")
        async with coordinator_harness(served, store=store, max_body_bytes=MAX_BODY,
                                       max_blob_bytes=len(body), api_key="secret") as h:
            post = lambda d, content, headers=key: httpx.post(  # noqa: E731
                f"{h.url}/api/blobs/{d}", content=content, headers=headers, timeout=30)

            def chunks(data: bytes, size: int = 10_000):  # no Content-Length: counted as read
                for i in range(0, len(data), size):
                    yield data[i:i + size]

            def cut(data: bytes):  # the client fails half way through its body
                yield data[:len(data) // 2]
                raise ConnectionAbortedError("client gave up")

            with pytest.raises(ConnectionAbortedError):
                await in_thread(post, digest, cut(body))
            partials = lambda: list(store.blob_store(1).root.glob(".*.partial"))  # noqa: E731
            await wait_until(lambda: not partials(), "the cut upload's partial file to go")
            return store, {
                "no_key": (await in_thread(post, digest, body, {})).status_code,
                "head_no_key": (await in_thread(httpx.head, f"{h.url}/api/blobs/{digest}")
                                ).status_code,
                "mismatch": await in_thread(post, digest, body[:-1] + b"x"),
                "bad_digest": await in_thread(post, "sha256:abc", body),
                "too_large": await in_thread(post, digest, body + b"!"),
                "too_large_streamed": await in_thread(post, digest, chunks(body + b"!")),
                "streamed": (await in_thread(post, digest, chunks(body))).status_code,
            }

    store, out = run(scenario())
    assert out["no_key"] == 401 and out["head_no_key"] == 401
    assert out["mismatch"].status_code == 400 and "digest mismatch" in out["mismatch"].json()["error"]
    assert out["bad_digest"].status_code == 400 and "invalid digest" in out["bad_digest"].json()["error"]
    for key_ in ("too_large", "too_large_streamed"):
        assert out[key_].status_code == 413 and "blob too large" in out[key_].json()["error"]
    assert out["streamed"] == 201
    blobs = store.blob_store(1 << 30)
    assert [p.name for p in blobs.root.iterdir()] == [f"sha256-{digest[7:]}"]  # no partials
    assert blobs.path(digest).read_bytes() == body


def test_create_from_a_served_models_blob_with_a_template_is_kept_not_served(
        tiny_gguf, tmp_path):
    """A created name of the served file answers at once, unless create gave it a template of
    its own: the served model keeps rendering its own, and the name waits for a restart."""
    digest = digest_of(tiny_gguf)

    async def scenario():
        store = ModelStore(tmp_path / "home")
        blobs = store.blob_store(1 << 30)
        blobs.root.mkdir(parents=True)
        blob = blobs.path(digest)
        blob.write_bytes(tiny_gguf.read_bytes())
        served = load_served_model(blob, "base")
        tokens = served.tokenizer.encode("ok", add_special_tokens=False)
        async with coordinator_harness(served, store=store) as h:
            worker = await h.add_worker("d1", "decode", Script(tokens=tokens))
            c = ollama.Client(host=h.url, timeout=60)
            await in_thread(c.create, "alias", files={"t.gguf": digest})
            await in_thread(c.create, "templated", files={"t.gguf": digest}, template=TEMPLATE)
            chat = await in_thread(c.chat, model="alias", messages=MESSAGES)
            unserved = await refusal(c.chat, model="templated", messages=MESSAGES)
            return served, worker, chat, unserved

    served, worker, chat, unserved = run(scenario())
    assert chat.message.content == "ok"
    prompt = served.tokenizer.decode(list(worker.requests[0].prompt_token_ids))
    assert "Hello there" in prompt and "<|sys|>" not in prompt
    assert unserved.status_code == 404
    assert "the model store holds it, but this server does not serve it" in unserved.error
    assert "tandem serve --model templated" in unserved.error
