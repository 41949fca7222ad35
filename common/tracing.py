"""OpenTelemetry traces across the disaggregated path, free when off.

    coordinator  "POST /api/chat" (server span, coordinator/access_log.py)
                 └─ "flow.attempt" (one placement: its workers and reason, request_flow.py)
                    │   traceparent in the gRPC metadata of both calls (W3C trace context)
    prefill      ├─ "prefill" (server span: the Prefill RPC, queue + chunks, first token)
    decode       └─ "decode" (server span: the Generate RPC, to the last token)
                       └─ "kv_transfer" (a remote prefill: from the grant to the first tokens
                          event, which waits for every layer's KV; the bytes moved)

On when a process is given `--otlp-traces-endpoint URL` (as vLLM's flag) or the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT variables (read by the entry
points, which call `setup_tracing` once): spans go in batches over OTLP/HTTP protobuf (a URL
without a path gets OTLP's `/v1/traces`); the other OTEL_* variables (OTEL_BSP_*,
OTEL_EXPORTER_OTLP_HEADERS, ...) apply as the SDK reads them. It needs the optional packages
`opentelemetry-sdk` and `opentelemetry-exporter-otlp-proto-http` (`pip install 'tandem[otel]'`);
without them a tracing setting is a start-up error, never silently ignored. Off, every helper
here returns a no-op at once and touches no OpenTelemetry code.

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
MISSING_PACKAGES = ("traces need the optional packages opentelemetry-sdk and "
                    "opentelemetry-exporter-otlp-proto-http (pip install 'tandem[otel]')")

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


def traces_url(endpoint: str) -> str:
    """`endpoint` as the OTLP/HTTP exporter wants it: a full URL to the traces path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


def setup_tracing(service_name: str, endpoint: str | None) -> bool:
    """Turn traces on for this process (`endpoint`: from endpoint_from; None = stay off).
    ValueError for a bad URL or missing packages, so the entry point fails at start-up."""
    global _tracer
    if endpoint is None:
        return False
    url = traces_url(endpoint) if endpoint else None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ValueError(MISSING_PACKAGES) from None
    # shutdown_on_exit (the default): the last batch is sent when the process exits normally.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=url) if url else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("tandem")
    return True


def _kind(name: str):
    from opentelemetry.trace import SpanKind

    return getattr(SpanKind, name.upper())


def start_span(name: str, *, parent=None, kind: str = "internal",
               attributes: Mapping[str, Any] | None = None):
    """A span the caller ends (span.end()); `parent`: a context from `extract` or a span (None:
    the current context's span). Not made current."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    if isinstance(parent, trace.Span):
        parent = trace.set_span_in_context(parent)
    return _tracer.start_span(name, context=parent, kind=_kind(kind),
                              attributes=dict(attributes or {}))


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
    """--otlp-traces-endpoint, the same in every process (vLLM's name)."""
    parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                        help="send OpenTelemetry traces over OTLP/HTTP to URL (e.g. "
                             "http://collector:4318; a URL without a path gets /v1/traces); "
                             "default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                             "$OTEL_EXPORTER_OTLP_ENDPOINT, else no traces. Needs tandem[otel]")
