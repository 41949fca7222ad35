"""OpenTelemetry traces across the three processes: a real cluster exports to a small
collector in this test, the workers over OTLP/HTTP (an HTTP server decoding OTLP protobuf) and
the coordinator over OTLP/gRPC (a gRPC TraceService), and one request's spans form one trace:
the coordinator's request span with its admission and placement, the attempt's span, the
prefill worker's and the decode worker's server spans below it, and their finer spans (the
prefill queue and chunks, the KV transfer's grant, layers and finish, the decode steps)."""

from __future__ import annotations

import gzip
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (opentelemetry-sdk)")
trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="needs the otel extra (opentelemetry-exporter-otlp-proto-http)")
trace_service_pb2_grpc = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
    reason="needs the otel extra (opentelemetry-proto)")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc",
                    reason="needs the otel extra (opentelemetry-exporter-otlp-proto-grpc)")

from common import tracing  # noqa: E402
from reliability.model_factory import make_tiny_hf_model  # noqa: E402
from tests.helpers.api_cluster import MODEL, WORKER_ARGS  # noqa: E402
from tests.helpers.cluster import running_cluster  # noqa: E402


class Collector:
    """OTLP's trace endpoints: over HTTP, POST /v1/traces with an ExportTraceServiceRequest
    (at `url`); over gRPC, TraceService.Export (at `grpc_url`). Spans from both land in one
    list, each with the protocol it came by."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC's name)
                collector.take(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.grpc_server)
        port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        self.grpc_server.start()
        self.grpc_url = f"http://127.0.0.1:{port}"

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == tracing.OTLP_TRACES_PATH and \
                    self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    collector.take(trace_service_pb2.ExportTraceServiceRequest.FromString(body),
                                   "http")
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

    def take(self, request, via: str) -> None:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    with self.lock:
                        self.spans.append({
                            "service": service, "name": s.name, "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "kind": s.kind, "via": via, "status": s.status.code,
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "events": [e.name for e in s.events], "attributes": {
                                a.key: a.value.WhichOneof("value") and getattr(
                                    a.value, a.value.WhichOneof("value"))
                                for a in s.attributes}})

    def trace_of(self, request_id: str, services: int, timeout_s: float = 30.0,
                 wanted: frozenset[str] = frozenset()) -> list[dict]:
        """The spans of the trace whose root carries `request_id`, polled until they come from
        `services` processes, the decode span ended and every span of `names` is in (the
        exporters send in batches; the KV transfer's spans end after the answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                spans = list(self.spans)
            roots = [s for s in spans if s["attributes"].get("tandem.request_id") == request_id
                     and s["service"] == "tandem-coordinator"]
            found = [s for s in spans if roots and s["trace"] == roots[0]["trace"]]
            seen = {s["name"] for s in found}
            if (len({s["service"] for s in found}) >= services
                    and {"decode", "prefill", *wanted} <= seen) or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.grpc_server.stop(grace=None)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("traces")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    collector = Collector()
    # The SDK's standard variable: batches go out every 100 ms, not 5 s (children inherit it).
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    flag = ("--otlp-traces-endpoint", collector.url)  # no path: /v1/traces is added
    over_grpc = ("--otlp-traces-endpoint", collector.grpc_url, "--otlp-traces-protocol", "grpc")
    try:
        with running_cluster(model_dir, root / "logs", model=MODEL, prefill_threshold=0,
                             worker_args=(*WORKER_ARGS, *flag), coordinator_args=over_grpc) as c:
            yield c, collector
    finally:
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved
        collector.close()


# The finer spans each process adds (common/tracing.py, worker/trace_spans.py).
FINER = frozenset({"admission", "placement", "prefill.queue", "prefill.chunk", "kv.send",
                   "kv.grant", "kv.layers", "kv.finish", "decode.steps"})


def test_one_request_is_one_trace_across_three_processes(traced):
    cluster, collector = traced
    rid = f"trace-{uuid.uuid4().hex[:12]}"
    r = httpx.post(cluster.url + "/api/chat", headers={"X-Request-Id": rid}, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
        "stream": False, "options": {"temperature": 0, "num_predict": 6}})
    assert r.status_code == 200, r.text
    spans = collector.trace_of(rid, services=3, wanted=FINER)
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
    # Each process exported by its own protocol: the coordinator over gRPC, the workers HTTP.
    assert {s["via"] for s in spans if s["service"] == "tandem-coordinator"} == {"grpc"}
    assert {s["via"] for s in spans if s["service"] != "tandem-coordinator"} == {"http"}
    assert FINER <= set(by_name), sorted(by_name)
    # The coordinator: admission (workers, weights, a slot) and placement, under the request.
    for name in ("admission", "placement"):
        assert by_name[name]["service"] == "tandem-coordinator"
        assert request in ancestors(by_name[name])
    assert by_name["admission"]["end"] <= by_name["placement"]["start"] <= attempt["start"]
    assert by_name["placement"]["attributes"]["tandem.placement"] == \
        attempt["attributes"]["tandem.placement"]
    # The prefill worker: its queue, then its chunks, which computed the uncached prompt.
    queue = by_name["prefill.queue"]
    chunks = [s for s in spans if s["name"] == "prefill.chunk"]
    assert queue["parent"] == prefill["id"] and chunks
    assert all(c["parent"] == prefill["id"] and c["service"] == "tandem-prefill" for c in chunks)
    assert queue["end"] <= min(c["start"] for c in chunks)
    assert sum(c["attributes"]["tandem.chunk_tokens"] for c in chunks) == \
        prefill["attributes"]["tandem.prompt_tokens"] - prefill["attributes"]["tandem.cached_tokens"]
    # The KV transfer, from the sending side: granted, its layers, its finish, in order.
    send = by_name["kv.send"]
    assert send["parent"] == prefill["id"] and send["status"] != 2  # not STATUS_CODE_ERROR
    assert send["attributes"]["tandem.kv_units"] >= 1
    stages = [by_name[n] for n in ("kv.grant", "kv.layers", "kv.finish")]
    assert all(s["parent"] == send["id"] for s in stages)
    assert send["start"] == stages[0]["start"] and stages[-1]["end"] == send["end"]
    assert stages[1]["start"] >= stages[0]["end"] and stages[2]["start"] >= stages[1]["start"]
    # The decode worker: one span over its steps, a step per token it streamed (the first
    # token came from the prefill worker).
    steps = by_name["decode.steps"]
    assert steps["parent"] == decode["id"] and steps["start"] >= transfer["start"]
    assert steps["attributes"]["tandem.steps"] == decode["attributes"]["tandem.output_tokens"]
    assert steps["events"] == ["step"] * steps["attributes"]["tandem.steps"]
    assert "decode.queue" not in by_name  # a remote prefill: kv_transfer is that wait
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
    # The protocol: the flag, else OTLP's variables (the traces one first), else HTTP.
    assert tracing.protocol_from(None, {}) == "http/protobuf"
    assert tracing.protocol_from(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert tracing.protocol_from(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
                                 ) == "http/protobuf"
    assert tracing.protocol_from("grpc", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "grpc"
    with pytest.raises(ValueError, match="must be one of http/protobuf, grpc, got 'http/json'"):
        tracing.protocol_from(None, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    with pytest.raises(ValueError, match="must be an http\\(s\\) URL"):
        tracing.setup_tracing("x", "collector:4317", "grpc")
    assert not tracing.enabled()  # a refused setting turned nothing on
