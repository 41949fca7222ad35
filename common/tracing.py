"""OpenTelemetry traces across the disaggregated path, free when off.

    coordinator  "POST /api/chat" (server span, coordinator/access_log.py)
                 └─ "flow.attempt" (one placement: its workers and reason, request_flow.py)
                    │   traceparent in the gRPC metadata of both calls (W3C trace context)
    prefill      ├─ "prefill" (server span: the Prefill RPC, queue + chunks, first token)
    decode       └─ "decode" (server span: the Generate RPC, to the last token)
                       └─ "kv_transfer" (a remote prefill: from the grant to the first tokens
                          event, which waits for every layer's KV; the bytes moved)

Each worker adds finer spans below its server span (prefill queue and chunks, the KV
transfer's grant, layers and finish, decode queue and steps: worker/trace_spans.py), and the
coordinator an `admission` span (waiting for workers, weights and a slot) and a `placement`
span beside each attempt.

On when a process is given `--otlp-traces-endpoint URL` (as vLLM's flag) or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables (read by the entry
points, which call `setup_tracing` once): spans go in batches over OTLP, by default HTTP
protobuf (a URL without a path gets OTLP's `/v1/traces`), or gRPC with `--otlp-traces-protocol
grpc` or the standard OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (an
http:// URL is a plaintext channel, https:// TLS; collectors listen on 4317 for gRPC and 4318
for HTTP). The other OTEL_* variables (OTEL_BSP_*, OTEL_EXPORTER_OTLP_HEADERS, ...) apply as
the SDK reads them. It needs the optional packages `opentelemetry-sdk` and the protocol's
exporter, `opentelemetry-exporter-otlp-proto-http` or `-grpc` (`pip install 'tandem[otel]'`
has both); without them a tracing setting is a start-up error, never silently ignored. Off,
every helper here returns a no-op at once and touches no OpenTelemetry code.

Spans are started without becoming the context's current span where their code spans awaits
in a generator (a stream's span ends in its `finally`), so a generator closed from another
task never detaches a context it did not attach. Torch-free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

OTLP_TRACES_PATH = "/v1/traces"
ENV_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
ENV_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("http/protobuf", "grpc")  # OTLP's names; the Python SDK has no http/json exporter
DEFAULT_PROTOCOL = "http/protobuf"  # the OTLP spec's default for SDKs
MISSING_PACKAGES = ("traces over {protocol} need the optional packages opentelemetry-sdk and "
                    "opentelemetry-exporter-otlp-proto-{package} (pip install 'tandem[otel]')")

_tracer = None  # the process's tracer once setup_tracing turned traces on; None = off


class _NoSpan:
    """What every helper hands out while traces are off."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def record_exception(self, exc: BaseException) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN = _NoSpan()


def enabled() -> bool:
    return _tracer is not None


def endpoint_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The endpoint the entry point was given: the flag, else "" when an OTEL_* variable names
    one (the exporter reads it itself), else None (off)."""
    if flag:
        return flag
    return "" if any(environ.get(name, "").strip() for name in ENV_ENDPOINTS) else None


def protocol_from(flag: str | None, environ: Mapping[str, str]) -> str:
    """The OTLP protocol: the flag, else the OTEL_* variable, else http/protobuf. ValueError
    names an unknown one (at start-up, like a bad URL)."""
    chosen = flag or next((environ[name].strip() for name in ENV_PROTOCOLS
                           if environ.get(name, "").strip()), DEFAULT_PROTOCOL)
    if chosen not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol must be one of {', '.join(PROTOCOLS)}, "
                         f"got {chosen!r}")
    return chosen


def traces_url(endpoint: str) -> str:
    """`endpoint` as the OTLP/HTTP exporter wants it: a full URL to the traces path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def _exporter(protocol: str, endpoint: str):
    """The SDK's OTLP span exporter for `protocol`, sending to `endpoint` ("" = the OTEL_*
    variables). ImportError when its package is missing."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if not endpoint:
            return OTLPSpanExporter()
        traces_url(endpoint)  # the same URL shape for both protocols: ValueError otherwise
        # The gRPC exporter takes scheme://host:port (a path means nothing to a channel);
        # http:// is a plaintext channel, https:// TLS.
        parts = urlsplit(endpoint)
        return OTLPSpanExporter(endpoint=f"{parts.scheme}://{parts.netloc}",
                                insecure=parts.scheme == "http")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()


def setup_tracing(service_name: str, endpoint: str | None,
                  protocol: str = DEFAULT_PROTOCOL) -> bool:
    """Turn traces on for this process (`endpoint`: from endpoint_from, None = stay off;
    `protocol`: from protocol_from). ValueError for a bad URL or protocol or missing packages,
    so the entry point fails at start-up."""
    global _tracer
    if endpoint is None:
        return False
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol must be one of {', '.join(PROTOCOLS)}, "
                         f"got {protocol!r}")
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = _exporter(protocol, endpoint)
    except ImportError:
        raise ValueError(MISSING_PACKAGES.format(
            protocol=protocol, package="grpc" if protocol == "grpc" else "http")) from None
    # shutdown_on_exit (the default): the last batch is sent when the process exits normally.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("tandem")
    return True


def _kind(name: str):
    from opentelemetry.trace import SpanKind

    return getattr(SpanKind, name.upper())


def _context(parent):
    """A span given as parent, as the context the SDK takes (a context passes as it is)."""
    from opentelemetry import trace

    return trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent


def start_span(name: str, *, parent=None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None):
    """A span the caller ends (span.end()); `parent`: a context from `extract` or a span (None:
    the current context's span). Not made current."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_span(name, context=_context(parent), kind=_kind(kind),
                              attributes=dict(attributes or {}))


def span_between(name: str, parent, start_ns: int, end_ns: int,
                 attributes: Mapping[str, Any] | None = None, error: str = "",
                 events: Iterable[tuple[str, int, Mapping[str, Any]]] = ()):
    """A span recorded after the fact, from times another thread took (wall-clock ns, as
    time.time_ns): started at start_ns under `parent`, given `events` (name, time, attributes),
    ended at end_ns; `error` marks it failed with that description. Returned ended."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry.trace import Status, StatusCode

    span = _tracer.start_span(name, context=_context(parent), start_time=start_ns,
                              attributes=dict(attributes or {}))
    for event, at_ns, event_attributes in events:
        span.add_event(event, dict(event_attributes), timestamp=at_ns)
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=max(end_ns, start_ns))
    return span


@contextlib.contextmanager
def current_span(name: str, *, parent=None, kind: str = "internal",
                 attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span that is the current one inside the block (a plain coroutine's body, never across
    a generator's yields), ended on exit; an exception leaving the block is recorded on it."""
    if _tracer is None:
        yield NO_SPAN
        return
    from opentelemetry import trace

    span = start_span(name, parent=parent, kind=kind, attributes=attributes)
    with trace.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield span


@contextlib.contextmanager
def server_span(name: str, attributes: Mapping[str, Any]) -> Iterator[Any]:
    """The span of a request this process serves: the one already current when a framework
    opened it (FastAPI's own instrumentation does, around its middleware), given `attributes`,
    else a new server span (current_span)."""
    if _tracer is None:
        yield NO_SPAN
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        for key, value in attributes.items():
            span.set_attribute(key, value)
        yield span
        return
    with current_span(name, kind="server", attributes=attributes) as span:
        yield span


def metadata(span=None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span`'s context (None: the current span's) as W3C `traceparent`
    (and `tracestate`); empty when traces are off."""
    if _tracer is None:
        return ()
    from opentelemetry import propagate, trace

    context = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items())


def extract(pairs: Iterable[tuple[str, str | bytes]] | None):
    """The parent context a caller sent in its gRPC metadata (None when traces are off)."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    carrier = {k: (v.decode("ascii", "replace") if isinstance(v, bytes) else v)
               for k, v in pairs or () if k in ("traceparent", "tracestate")}
    return propagate.extract(carrier)


def add_tracing_flag(parser) -> None:
    """--otlp-traces-endpoint and --otlp-traces-protocol, the same in every process (the
    first is vLLM's name)."""
    parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                        help="send OpenTelemetry traces over OTLP to URL (e.g. "
                             "http://collector:4318; over HTTP a URL without a path gets "
                             "/v1/traces); default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                             "$OTEL_EXPORTER_OTLP_ENDPOINT, else no traces. Needs tandem[otel]")
    parser.add_argument("--otlp-traces-protocol", choices=PROTOCOLS, default=None,
                        help="OTLP over HTTP (http/protobuf, to port 4318) or gRPC (grpc, to "
                             "port 4317; an http:// URL is plaintext, https:// TLS); default: "
                             "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or $OTEL_EXPORTER_OTLP_PROTOCOL, "
                             "else http/protobuf")
