"""`dimensions` on /v1/embeddings (the real `openai` client) and Ollama's /api/embed (the real
`ollama` client): each vector truncated and L2-normalized again, as Ollama does; a 400 naming
the field outside 1..the model's embedding size."""

from __future__ import annotations

import math

import httpx
import ollama
import openai
import pytest

from tests.helpers.api_cluster import MODEL, api  # noqa: F401 (fixture)

TEXTS = ["The cat sat on the mat.", "Rivers flow to the sea."]


@pytest.fixture(scope="module")
def hidden(api) -> int:
    r = httpx.post(api.url + "/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=60)
    return len(r.json()["data"][0]["embedding"])


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _expected(full: list[float], dims: int) -> list[float]:
    head = full[:dims]
    return [x / _norm(head) for x in head]


def test_openai_dimensions_truncate_and_renormalize(api, hidden):
    oai = openai.OpenAI(base_url=api.url + "/v1", api_key="x", timeout=60, max_retries=0)
    full = oai.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    dims = hidden // 4
    short = oai.embeddings.create(model=MODEL, input=TEXTS, dimensions=dims,
                                  encoding_format="float")
    # The client's default base64 path, decoded by the client itself.
    short_b64 = oai.embeddings.create(model=MODEL, input=TEXTS, dimensions=dims)
    for f, s, b in zip(full.data, short.data, short_b64.data):
        assert len(s.embedding) == len(b.embedding) == dims
        assert abs(_norm(s.embedding) - 1) < 1e-6
        assert s.embedding == pytest.approx(_expected(f.embedding, dims), abs=1e-6)
        assert b.embedding == pytest.approx(s.embedding, abs=1e-6)
    same = oai.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=hidden,
                                 encoding_format="float")
    assert same.data[0].embedding == pytest.approx(full.data[0].embedding, abs=1e-6)


def test_ollama_embed_dimensions(api, hidden):
    client = ollama.Client(host=api.url, timeout=60)
    full = client.embed(model=MODEL, input=TEXTS)
    short = client.embed(model=MODEL, input=TEXTS, dimensions=3)
    for f, s in zip(full.embeddings, short.embeddings):
        assert len(s) == 3 and abs(_norm(s) - 1) < 1e-6
        assert list(s) == pytest.approx(_expected(list(f), 3), abs=1e-6)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/api/embed"])
def test_dimensions_out_of_range_are_400s_naming_the_field(api, hidden, path):
    for bad in (0, -1, hidden + 1, 2.5, True, "8"):
        r = httpx.post(api.url + path, json={"model": MODEL, "input": "x", "dimensions": bad},
                       timeout=30)
        assert r.status_code == 400, (bad, r.text)
        body = r.json()
        message = body["error"]["message"] if path.startswith("/v1") else body["error"]
        assert f"dimensions must be an integer between 1 and {hidden}" in message
