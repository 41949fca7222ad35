"""Schemathesis against the coordinator's own /openapi.json, on a live coordinator with a fake
decode worker (tests/helpers/coordinator_fakes.py).

Every operation gets FUZZ_HTTP_EXAMPLES (default 25) generated requests in each of
schemathesis's modes, checked as reliability/fuzz_http.py says (no undocumented 5xx, documented
content types, schema-invalid bodies refused, no traceback text). The first test checks that
the schema describes the request bodies at all.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
# Imported here, at collection, not lazily inside a test: pytest rewrites the asserts of the
# schemathesis plugin's modules as they are first imported, with ast.parse, and CPython 3.11
# keeps the AST constructor's recursion depth in state shared by every thread, so a parse
# that runs beside another thread's (the live server's) can fail spuriously with "SystemError:
# AST constructor recursion depth mismatch" (cpython gh-106905; seen once in CI).
import schemathesis.specs.openapi.schemas  # noqa: F401

from coordinator.request_schemas import REQUEST_BODIES
from reliability.fuzz_http import fuzz_http
from common.model_store import ModelStore
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, harness_on_thread, load_model, make_tiny_model_dir,
)

EXAMPLES = int(os.environ.get("FUZZ_HTTP_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(base url, the fake decode worker) of a coordinator running on its own thread."""
    model = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    tokens = model.tokenizer.encode("Hello there", add_special_tokens=False)
    # A store with nothing to pull: /api/pull answers 404 without pip; copy, create and delete
    # work on a store of their own.
    store = ModelStore(tmp_path_factory.mktemp("home"), registry={})

    async def setup(h):
        return h.url, await h.add_worker("d1", "decode", Script(tokens=tokens))

    with harness_on_thread(model, setup, store, prefill_threshold=10_000) as live:
        yield live


def test_the_schema_describes_every_request_body(live):
    url, _ = live
    doc = httpx.get(f"{url}/openapi.json", timeout=DEADLINE_S).json()
    components = doc["components"]["schemas"]
    for (method, path), model in REQUEST_BODIES.items():
        operation = doc["paths"][path][method]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        body = components[ref.rsplit("/", 1)[1]]
        assert body["type"] == "object" and body["properties"], (method, path)
        assert "400" in operation["responses"] and "503" in operation["responses"]
    # Spot checks that the bodies say what the parsers take.
    chat = components["ChatRequest"]
    assert chat["required"] == ["model"]
    assert set(components["OllamaMessage"]["properties"]["role"]["enum"]) == {
        "system", "user", "assistant", "tool"}
    assert components["OpenAIEmbeddingRequest"]["properties"]["encoding_format"]["anyOf"][0][
        "enum"] == ["float", "base64"]
    assert "/v1/models/{name}" in doc["paths"] and "/api/tags" in doc["paths"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_every_operation_answers_cleanly(live, mode):
    url, _ = live
    report = fuzz_http(url, EXAMPLES, modes=(mode,))
    assert not report.failures, "\n\n".join(report.failures[:3])
    # Every operation got requests (negative mode: those with something to break).
    assert len(report.labels) >= (20 if mode == "positive" else 12), report.labels
    for method, path in REQUEST_BODIES:  # ... those with a body at full size
        label = f"{method.upper()} {path}"
        assert report.labels[label] >= min(EXAMPLES, 10), (label, report.labels[label])
    codes = Counter(key.rsplit(" ", 1)[1] for key in report.statuses.elements())
    print(f"{mode}: {report.requests} requests over {len(report.labels)} operations, "
          f"{len(report.statuses)} distinct (operation, status) outcomes; {dict(codes)}")
