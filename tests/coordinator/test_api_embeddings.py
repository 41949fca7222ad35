"""Embeddings and a second real client, on the default model (SmolLM2) in one real cluster:
the `ollama` and `openai` Python clients' embedding calls, each API's errors, and the Ollama
JavaScript client (npm `ollama`, run with the machine's Node.js) for chat, stream and embed."""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import struct
import subprocess
import urllib.error
import urllib.request

import ollama
import openai
import pytest

from tests.helpers.cluster import running_cluster
from tests.conftest import tandem_home

pytestmark = pytest.mark.model

MODEL = "smollm2"
HIDDEN = 576  # SmolLM2-135M's hidden size
OLLAMA_JS_VERSION = "0.6.4"  # npm `ollama`, pinned
CATS = ["The cat sat on the warm windowsill, purring softly in the sun.",
        "A kitten curled up and purred, napping in a patch of sunlight."]
TAX = "Corporate income tax returns must be filed with the revenue authority by the fiscal deadline."


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    with running_cluster(default_gguf, root / "logs", model=MODEL, prefill_threshold=0) as cluster:
        yield cluster.url


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def unit(v: list[float]) -> bool:
    return len(v) == HIDDEN and abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_ollama_and_openai_clients_embed(server):
    client = ollama.Client(host=server, timeout=300)
    one = client.embed(model=MODEL, input=CATS[0])
    assert len(one.embeddings) == 1 and unit(one.embeddings[0])
    assert one.prompt_eval_count > 0 and one.total_duration > 0
    batch = client.embed(model=MODEL, input=[*CATS, TAX])
    assert len(batch.embeddings) == 3 and all(unit(v) for v in batch.embeddings)
    a, b, tax = batch.embeddings
    assert cosine(a, b) > cosine(a, tax) and cosine(a, b) > cosine(b, tax)
    # The batch computes each input as it would alone (mean pooling over its own tokens).
    assert cosine(one.embeddings[0], a) > 0.9999
    legacy = client.embeddings(model=MODEL, prompt=CATS[0])
    assert len(legacy.embedding) == HIDDEN
    assert cosine(legacy.embedding, a) > 0.9999

    oai = openai.OpenAI(base_url=server + "/v1", api_key="x", timeout=300)
    # The client asks for base64 and decodes it itself; the float form is checked below.
    got = oai.embeddings.create(model=MODEL, input=[*CATS, TAX])
    vectors = [d.embedding for d in sorted(got.data, key=lambda d: d.index)]
    assert len(vectors) == 3 and all(unit(v) for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert cosine(vectors[0], a) > 0.9999
    assert got.usage.prompt_tokens == got.usage.total_tokens == batch.prompt_eval_count
    single = oai.embeddings.create(model=MODEL, input=CATS[1], encoding_format="float",
                                   dimensions=HIDDEN)
    assert unit(single.data[0].embedding) and cosine(single.data[0].embedding, b) > 0.9999


def test_embedding_errors_in_each_apis_shape(server):
    status, body = post(server + "/api/embed", {"model": "nope", "input": "x"})
    assert status == 404 and isinstance(body["error"], str)
    for empty in ("", [], ["ok", ""]):
        status, body = post(server + "/api/embed", {"model": MODEL, "input": empty})
        assert status == 400 and isinstance(body["error"], str)
    long = {"model": MODEL, "input": TAX, "options": {"num_ctx": 4}}
    status, body = post(server + "/api/embed", {**long, "truncate": False})
    assert status == 400 and "context length" in body["error"]
    status, body = post(server + "/api/embed", long)  # truncated to 4 tokens
    assert status == 200 and body["prompt_eval_count"] == 4 and unit(body["embeddings"][0])

    status, body = post(server + "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and body["error"]["type"]
    status, body = post(server + "/v1/embeddings", {"model": MODEL, "input": []})
    assert status == 400 and body["error"]["message"]
    status, body = post(server + "/v1/embeddings", {"model": MODEL, "input": "x",
                                                     "dimensions": HIDDEN + 1})
    assert status == 400 and "dimensions" in body["error"]["message"]
    status, body = post(server + "/v1/embeddings", {"model": MODEL, "input": "x" * 60000})
    assert status in (400, 413) and body["error"]["message"]
    # Token arrays and base64, decoded by hand.
    status, body = post(server + "/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3], [4, 5]],
                                                     "encoding_format": "base64"})
    assert status == 200 and body["object"] == "list" and body["usage"]["prompt_tokens"] == 5
    raw = base64.b64decode(body["data"][1]["embedding"])
    assert unit(list(struct.unpack(f"<{HIDDEN}f", raw)))


def test_last_token_pooling_on_every_route(server):
    """tandem's `pooling` field: "last" gives the last position's state (the response cache's
    embedding), on Ollama's routes and through the openai client's extra_body alike, for each
    input of a batch as alone; another value is a 400 naming the field."""
    status, mean = post(server + "/api/embed", {"model": MODEL, "input": CATS})
    assert status == 200
    status, last = post(server + "/api/embed", {"model": MODEL, "input": CATS, "pooling": "last"})
    assert status == 200 and all(unit(v) for v in last["embeddings"])
    assert cosine(last["embeddings"][0], mean["embeddings"][0]) < 0.99
    status, alone = post(server + "/api/embed", {"model": MODEL, "input": CATS[1],
                                                 "pooling": "last"})
    assert status == 200 and cosine(alone["embeddings"][0], last["embeddings"][1]) > 0.9999
    status, legacy = post(server + "/api/embeddings", {"model": MODEL, "prompt": CATS[0],
                                                       "pooling": "last"})
    assert status == 200 and cosine(legacy["embedding"], last["embeddings"][0]) > 0.9999
    oai = openai.OpenAI(base_url=server + "/v1", api_key="x", timeout=300)
    got = oai.embeddings.create(model=MODEL, input=CATS[0], encoding_format="float",
                                extra_body={"pooling": "last"})
    assert cosine(got.data[0].embedding, last["embeddings"][0]) > 0.9999
    for bad in ("max", 1, "", ["last"]):
        status, body = post(server + "/api/embed", {"model": MODEL, "input": "x", "pooling": bad})
        assert status == 400 and "pooling must be one of 'mean', 'last'" in body["error"], bad
    status, body = post(server + "/v1/embeddings", {"model": MODEL, "input": "x", "pooling": "cls"})
    assert status == 400 and "pooling" in body["error"]["message"]


JS_CLIENT = r"""
import { Ollama } from 'ollama';
const [host, model] = process.argv.slice(2);
const client = new Ollama({ host });
const messages = [{ role: 'user', content: 'List four primary colors.' }];
const options = { temperature: 0, num_predict: 16 };
const chat = await client.chat({ model, messages, options });
let streamed = '';
let chunks = 0;
let done = null;
for await (const part of await client.chat({ model, messages, options, stream: true })) {
  streamed += part.message.content;
  chunks += 1;
  if (part.done) done = part.done_reason;
}
const embed = await client.embed({ model, input: ['The cat purred.', 'A kitten purred.', 'Tax law.'] });
console.log(JSON.stringify({ chat: chat.message.content, chatDone: chat.done, streamed, chunks, done,
  embeddings: embed.embeddings, promptEvalCount: embed.prompt_eval_count }));
"""


def ollama_js(tmp_path) -> str:
    """The npm package `ollama` at OLLAMA_JS_VERSION, installed once into $TANDEM_HOME/npm
    (outside the repo, kept between runs); returns its node_modules folder."""
    prefix = tandem_home() / "npm" / f"ollama-{OLLAMA_JS_VERSION}"
    modules = prefix / "node_modules"
    if not (modules / "ollama" / "package.json").exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        f"ollama@{OLLAMA_JS_VERSION}"], check=True, timeout=300,
                       capture_output=True)
    return str(modules)


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                    reason="Node.js (node and npm) is not installed on this machine, so the "
                           "Ollama JavaScript client cannot run; CI machines have it")
def test_ollama_javascript_client_chat_stream_and_embed(server, tmp_path):
    modules = ollama_js(tmp_path)
    script = tmp_path / "client.mjs"
    script.write_text(JS_CLIENT)
    os.symlink(modules, tmp_path / "node_modules")  # ESM resolves packages from the script's folder
    run = subprocess.run(["node", str(script), server, MODEL], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["chatDone"] is True and out["chat"].strip()
    assert out["streamed"] == out["chat"] and out["chunks"] > 1 and out["done"] in ("stop", "length")
    cat, kitten, tax = out["embeddings"]
    assert all(unit(v) for v in out["embeddings"]) and out["promptEvalCount"] > 0
    assert cosine(cat, kitten) > cosine(cat, tax)
