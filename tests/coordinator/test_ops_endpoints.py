"""The endpoints that probes and vLLM-minded tools call: /health, /version, /tokenize,
/detokenize and /tokenizer_info, on the real coordinator with fake workers."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.rpc import worker_pb2 as pb
from coordinator.model import load_served_model
from coordinator.http_api import DOCS_ASSETS

from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, coordinator_harness, load_model, make_tiny_model_dir, run, wait_until,
)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_health_needs_a_worker_that_decodes(model):
    async def scenario():
        answers = []
        async with coordinator_harness(model) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            answers.append(await client.get(f"{h.url}/health"))
            await h.add_worker("p1", "prefill", Script())
            answers.append(await client.get(f"{h.url}/health"))
            await h.add_worker("d1", "decode", Script())
            answers.append(await client.get(f"{h.url}/health"))
            version = await client.get(f"{h.url}/version")
        return answers, version

    (none, prefill_only, ready), version = run(scenario())
    assert none.status_code == 503 and none.json()["status"] == "unavailable"
    assert "no live decode or colocated worker serves tiny" in none.json()["reason"]
    assert prefill_only.status_code == 503
    assert "1 prefill worker(s) live" in prefill_only.json()["reason"]
    assert prefill_only.json()["live_workers"]["prefill"] == 1
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    assert ready.json()["model"] == "tiny"
    assert version.status_code == 200 and isinstance(version.json()["version"], str)


def test_tokenize_and_detokenize_in_vllms_shapes(model):
    tok = model.tokenizer

    async def scenario():
        async with coordinator_harness(model) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            async def post(path, **body):
                return await client.post(f"{h.url}{path}", json={"model": "tiny", **body})
            return [
                await post("/tokenize", prompt="Hello world"),
                await post("/tokenize", prompt="Hello world", add_special_tokens=False,
                           return_token_strs=True),
                await post("/tokenize", messages=MESSAGES),
                await post("/detokenize", tokens=tok.encode("Hello world", False)),
                await post("/tokenize", prompt="x", messages=MESSAGES),
                await post("/detokenize", tokens=[10 ** 9]),
                await post("/detokenize", tokens=[True]),
                await client.post(f"{h.url}/tokenize", json={"model": "other", "prompt": "x"}),
                # found by tests/reliability/test_fuzz_http.py: tools beside a prompt were ignored
                await post("/tokenize", prompt="x", tools=[{"type": "", "function": {"name": "f"}}]),
            ]

    plain, bare, chat, text, both, outside, boolean, other, prompt_tools = run(scenario())
    assert plain.status_code == 200, plain.text
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert plain.json() == {"tokens": ids, "count": len(ids), "max_model_len": model.context_len,
                            "token_strs": None}
    bare_ids = tok.encode("Hello world", add_special_tokens=False)
    assert bare.json()["tokens"] == bare_ids
    assert bare.json()["token_strs"] == [tok.id_to_token(i) for i in bare_ids]
    # Messages count as /v1/chat/completions would prefill them.
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat.json()["tokens"] == tok.encode(rendered)
    assert chat.json()["count"] == len(tok.encode(rendered))
    assert text.status_code == 200 and text.json() == {"prompt": "Hello world"}
    for bad in (both, outside, boolean, prompt_tools):
        assert bad.status_code == 400, bad.text
        assert isinstance(bad.json()["error"]["message"], str)  # OpenAI's shape, as vLLM
    assert other.status_code == 404


def test_the_tokenizer_endpoints_as_lm_evals_remote_tokenizer_calls_them(model, tmp_path):
    """lm-eval's RemoteTokenizer reads GET /tokenizer_info, then posts /tokenize and
    /detokenize without a `model` (as vLLM allows): the only served model answers. With two
    served models, a request that names none is a 400 that says so, and ?model= picks one."""
    tok = model.tokenizer
    other = load_served_model(make_tiny_model_dir(tmp_path / "other", max_position=256), "other")

    async def scenario():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            async with coordinator_harness(model) as h:
                one = [await client.get(f"{h.url}/tokenizer_info"),
                       await client.post(f"{h.url}/tokenize",
                                         json={"prompt": "Hello world", "add_special_tokens": False}),
                       await client.post(f"{h.url}/detokenize",
                                         json={"tokens": tok.encode("Hello world", False)}),
                       await client.get(f"{h.url}/tokenizer_info", params={"model": "nope"})]
            async with coordinator_harness([model, other]) as h:
                two = [await client.get(f"{h.url}/tokenizer_info"),
                       await client.post(f"{h.url}/tokenize", json={"prompt": "x"}),
                       await client.get(f"{h.url}/tokenizer_info", params={"model": "other"})]
        return one, two

    (info, tokens, text, unknown), (unnamed_info, unnamed, named) = run(scenario())
    assert info.status_code == 200, info.text
    assert info.json() == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.id_to_token(tok.eos_token_id),
        "bos_token": None if tok.bos_token_id is None else tok.id_to_token(tok.bos_token_id),
        "add_bos_token": tok.add_bos, "model_max_length": model.context_len,
        "chat_template": tok.chat_template}
    # The eos text tokenizes back to the one id (lm-eval's prefix for an empty context).
    assert tok.encode(info.json()["eos_token"], add_special_tokens=False) == [tok.eos_token_id]
    assert tokens.json()["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert text.json() == {"prompt": "Hello world"}
    assert unknown.status_code == 404
    for bad in (unnamed_info, unnamed):
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "model is required: 2 models are served"
    assert named.status_code == 200 and named.json()["model_max_length"] == 256


# ---- /metrics: vLLM's names and types, tandem's beside them ---------------------------------------

VLLM_SERIES = {
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}
TANDEM_COUNTERS = ("tandem_worker_kv_sent_bytes", "tandem_worker_kv_received_bytes",
                   "tandem_worker_kv_transfers", "tandem_worker_kv_transfer_seconds",
                   "tandem_worker_kv_skipped_blocks", "tandem_worker_kv_auth_rejected",
                   "tandem_grpc_refused_calls", "tandem_request_migrations", "tandem_requests")


def test_metrics_speak_vllms_names_and_types(model):
    tok = model.tokenizer
    output = tok.encode("Hello there, river", add_special_tokens=False)
    prompt = len(tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)))

    async def scenario():
        async with coordinator_harness(model, prefill_threshold=0) as h:
            prefill = await h.add_worker("p1", "prefill", Script(tokens=output,
                                                                 num_cached_tokens=16))
            await h.add_worker("d1", "decode", Script(tokens=output))
            prefill.status.kv.CopyFrom(pb.KVTransferCounters(backend="zmq", bytes_sent=4096,
                                                             transfers_done=3))
            record = h.coordinator.registry.get("p1")
            await wait_until(lambda: record.kv is not None, "the counters in a heartbeat")
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                for _ in range(3):
                    answer = await client.post(f"{h.url}/api/chat", json={
                        "model": "tiny", "messages": MESSAGES, "stream": False})
                    assert answer.status_code == 200, answer.text
                return (await client.get(f"{h.url}/metrics")).text

    text = run(scenario())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_SERIES.items():
        assert families[name].type == kind, name
        assert all(s.labels.get("model_name") == "tiny" for s in families[name].samples), name
    for name in TANDEM_COUNTERS:
        assert families[name].type == "counter", name
    # No gauge is named like a counter or a histogram's parts.
    for family in families.values():
        if family.type == "gauge":
            assert not family.name.endswith(("_total", "_sum", "_count")), family.name

    def value(sample: str, **labels) -> float:
        name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
        name = name.removesuffix("_bucket")
        return sum(s.value for s in families[name].samples if s.name == sample
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_time_per_output_token_seconds"):
        assert value(f"{hist}_count") == 3, hist
        assert value(f"{hist}_bucket", le="+Inf") == 3, hist
    gaps = 3 * (len(output) - 1)
    assert value("vllm:inter_token_latency_seconds_count") == gaps
    assert value("vllm:time_per_output_token_seconds_count") == gaps
    # vLLM's boundaries
    les = {s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket")}
    assert {"0.001", "2560.0", "+Inf"} <= les and len(les) == 23
    assert value("vllm:prompt_tokens_total") == 3 * prompt
    assert value("vllm:generation_tokens_total") == 3 * len(output)
    assert value("vllm:prefix_cache_queries_total") == 3 * prompt
    assert value("vllm:prefix_cache_hits_total") == 3 * 16
    assert value("vllm:request_success_total", finished_reason="stop") == 3
    assert value("vllm:request_success_total", finished_reason="length") == 0
    assert value("vllm:num_requests_running") == 0 and value("vllm:num_requests_waiting") == 0
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    assert value("tandem_requests_total", outcome="stop") == 3
    assert value("tandem_worker_kv_sent_bytes_total", worker="p1", role="prefill") == 4096
    assert value("tandem_worker_kv_transfers_total", worker="p1", outcome="done") == 3
    assert value("tandem_worker_requests_waiting", worker="d1", role="decode") == 0
    assert value("tandem_live_workers", role="decode") == 1


def test_health_answers_probes_without_the_api_key_while_the_api_needs_it(model):
    async def scenario():
        async with coordinator_harness(model, api_key="sk-probe-test") as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            await h.add_worker("d1", "decode", Script())
            return (await client.get(f"{h.url}/health"),
                    await client.get(f"{h.url}/version"))

    health, version = run(scenario())
    assert health.status_code == 200
    assert version.status_code == 401


def test_swagger_ui_over_the_openapi_schema_and_root_still_answers_as_ollama(model):
    async def scenario():
        async with coordinator_harness(model) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return [await client.get(f"{h.url}{path}")
                    for path in ("/docs", "/openapi.json", "/", "/redoc",
                                 f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                 f"{DOCS_ASSETS}/swagger-ui.css")]

    docs, schema, root, redoc, script, style = run(scenario())
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle" in docs.text and "'/openapi.json'" in docs.text
    # The UI's script and style come from the coordinator itself, never a CDN.
    assert "cdn." not in docs.text and "https://" not in docs.text
    assert f"{DOCS_ASSETS}/swagger-ui-bundle.js" in docs.text
    assert f"{DOCS_ASSETS}/swagger-ui.css" in docs.text
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text
    assert style.status_code == 200 and ".swagger-ui" in style.text
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/api/chat", "/v1/chat/completions", "/health"} <= set(paths)
    assert "/docs" not in paths
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert redoc.status_code == 404
