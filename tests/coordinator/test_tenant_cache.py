"""The prefix cache is shared only within a tenant (coordinator/tenants.py): with an API keys
file, each key's requests hash their blocks with their own salt, and a request can split its
own traffic further with vLLM's `cache_salt`. Against a real cluster: a prompt that tenant A
sent is cached for A and a miss for B, so `cached_tokens` cannot tell B what A sent."""

from __future__ import annotations

import json
import urllib.request

import pytest

from reliability.model_factory import make_tiny_hf_model
from tests.helpers.cluster import running_cluster

KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}
PROMPT = " ".join(f"word{i}" for i in range(120))  # many full blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


def _post(url: str, path: str, key: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.load(r)


def _cached(url: str, tenant: str, **extra) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "stream": False,
            "options": {"temperature": 0, "num_predict": 2}, **extra}
    return _post(url, "/api/chat", KEYS[tenant], body)["tandem"]["cached_tokens"]


def _openai_cached(url: str, tenant: str, salt: str | None) -> int:
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    usage = _post(url, "/v1/chat/completions", KEYS[tenant], body)["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("topology", [
    {"colocated": True},  # prefilled where it decodes
    {"prefill_threshold": 1},  # every prompt prefilled by the prefill worker, its own cache
])
def test_tenants_do_not_see_each_other_s_cached_tokens(tiny, tmp_path, monkeypatch, topology):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenant key\n" + "".join(f"{n} {k}\n" for n, k in KEYS.items()))
    monkeypatch.setenv("TANDEM_API_KEYS_FILE", str(keys_file))  # the coordinator inherits it
    with running_cluster(tiny, tmp_path / "logs", **topology,
                         worker_args=("--decode-quant", "fp32", "--prefill-quant", "fp32",
                                      "--kv-cache-gb", "0.05")) as c:
        assert _cached(c.url, "alice") == 0  # cold
        assert _cached(c.url, "alice") > 0  # alice's own prefix
        assert _cached(c.url, "bob") == 0  # the same prompt: a miss for bob
        assert _cached(c.url, "bob") > 0  # bob's own copy now
        # cache_salt splits a tenant's own traffic; it never joins another tenant's
        assert _openai_cached(c.url, "alice", "session-1") == 0
        assert _openai_cached(c.url, "alice", "session-1") > 0
        assert _openai_cached(c.url, "bob", "session-1") == 0
        assert _openai_cached(c.url, "alice", None) > 0  # alice's unsalted blocks, still there
        c.wait_pools_full()
