"""OpenTelemetry traces across the three processes: a real cluster exports over OTLP/HTTP to a
small collector in this test (an HTTP server decoding OTLP protobuf), and one request's spans
form one trace: the coordinator's request span, its placement's span, the prefill worker's
and the decode worker's server spans below it, and the KV transfer below the decode span."""

from __future__ import annotations

import gzip
import os
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (opentelemetry-sdk)")
trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="needs the otel extra (opentelemetry-exporter-otlp-proto-http)")

from common import tracing  # noqa: E402
from reliability.model_factory import make_tiny_hf_model  # noqa: E402
from tests.helpers.api_cluster import MODEL, WORKER_ARGS  # noqa: E402
from tests.helpers.cluster import running_cluster  # noqa: E402


class Collector:
    """OTLP/HTTP's trace endpoint: POST /v1/traces with an ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == tracing.OTLP_TRACES_PATH and \
                    self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    collector.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse()
                                 .SerializeToString() if ok else b"")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request) -> None:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    with self.lock:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "kind": s.kind, "attributes": {
                                a.key: a.value.WhichOneof("value") and getattr(
                                    a.value, a.value.WhichOneof("value"))
                                for a in s.attributes}})

    def trace_of(self, request_id: str, services: int, timeout_s: float = 30.0) -> list[dict]:
        """The spans of the trace whose root carries `request_id`, polled until they come from
        `services` processes and the decode span ended (the exporters send in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            roots = [s for s in spans if s["attributes"].get("tandem.request_id") == request_id
                     and s["service"] == "tandem-coordinator"]
            found = [s for s in spans if roots and s["trace"] == roots[0]["trace"]]
            names = {s["name"] for s in found}
            if (len({s["service"] for s in found}) >= services and "decode" in names
                    and "prefill" in names) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("traces")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    collector = Collector()
    # The SDK's standard variable: batches go out every 100 ms, not 5 s (children inherit it).
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    flag = ("--otlp-traces-endpoint", collector.url)  # no path: /v1/traces is added
    try:
        with running_cluster(model_dir, root / "logs", model=MODEL, prefill_threshold=0,
                             worker_args=(*WORKER_ARGS, *flag), coordinator_args=flag) as c:
            yield c, collector
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
        collector.close()


def test_one_request_is_one_trace_across_three_processes(traced):
    cluster, collector = traced
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    r = httpx.post(cluster.url + "/api/chat", headers={"X-Request-Id": rid}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
        "stream": False, "options": {"temperature": 0, "num_predict": 6}})
    assert r.status_code == 200, r.text
    spans = collector.trace_of(rid, services=3)
    by_name = {s["name"]: s for s in spans}
    assert {s["service"] for s in spans} == {"tandem-coordinator", "tandem-prefill",
                                             "tandem-decode"}, spans
    assert len({s["trace"] for s in spans}) == 1
    by_id = {s["id"]: s for s in spans}

    def ancestors(span: dict) -> list[dict]:
        chain = []
        while span["parent"]:
            span = by_id[span["parent"]]
            chain.append(span)
        return chain

    (request,) = [s for s in spans if s["attributes"].get("tandem.request_id") == rid]
    attempt = by_name["flow.attempt"]
    prefill, decode, transfer = by_name["prefill"], by_name["decode"], by_name["kv_transfer"]
    assert request["service"] == "tandem-coordinator" and request["kind"] == 2  # SERVER
    assert request["attributes"]["http.response.status_code"] == 200
    # Every span hangs off one root in the coordinator (FastAPI may add spans between).
    (root,) = [s for s in spans if not s["parent"]]
    assert root["service"] == "tandem-coordinator"
    assert all(ancestors(s)[-1:] == [root] for s in spans if s is not root)
    assert request in [attempt, *ancestors(attempt)] and attempt["service"] == "tandem-coordinator"
    # The workers' spans continue the coordinator's, over the gRPC metadata's traceparent.
    assert prefill["parent"] == attempt["id"] and prefill["service"] == "tandem-prefill"
    assert decode["parent"] == attempt["id"] and decode["service"] == "tandem-decode"
    assert transfer["parent"] == decode["id"] and transfer["service"] == "tandem-decode"
    assert attempt["attributes"]["tandem.prefill_worker"] == "prefill-0"
    assert attempt["attributes"]["tandem.decode_worker"] == "decode-0"
    assert transfer["attributes"]["tandem.kv_bytes"] > 0
    assert decode["attributes"]["tandem.output_tokens"] >= 1
    # No span was written to after it ended (the SDK warns in the log when one is).
    for name in ("coordinator", "prefill-0", "decode-0"):
        assert "ended span" not in (cluster.log_dir / f"{name}.log").read_text()


def test_a_second_request_is_another_trace(traced):
    cluster, collector = traced
    ids = [f"again-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for rid in ids:
        r = httpx.post(cluster.url + "/api/generate", headers={"X-Request-Id": rid}, timeout=60,
                       json={"model": MODEL, "prompt": "Hello there", "stream": False,
                             "options": {"temperature": 0, "num_predict": 3}})
        assert r.status_code == 200, r.text
    first, second = (collector.trace_of(rid, services=3) for rid in ids)
    assert first and second and first[0]["trace"] != second[0]["trace"]


def test_bad_settings_fail_at_start_up():
    with pytest.raises(ValueError, match="must be an http\\(s\\) URL"):
        tracing.traces_url("collector:4318")
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/custom") == "http://c:4318/custom"
    assert tracing.endpoint_from(None, {}) is None
    assert tracing.endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ""
    assert tracing.endpoint_from("http://x:1", {}) == "http://x:1"
