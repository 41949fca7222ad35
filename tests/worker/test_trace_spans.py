"""The worker's finer spans from the engine's pass records and the sender's stage times
(worker/trace_spans.py), into an in-memory exporter: a local prefill's queue and chunks, decode
steps as events, a failed KV transfer marked failed with only the stages it reached, and
nothing at all while traces are off. The three-process path is tests/coordinator/test_traces.py."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra (opentelemetry-sdk)")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

from common import tracing  # noqa: E402
from engine.pass_record import PassRecord  # noqa: E402
from kvtransfer import TransferState, TransferStatus, TransferTimes  # noqa: E402
from worker import trace_spans  # noqa: E402

MS = 1_000_000


@pytest.fixture
def exported(monkeypatch):
    """Traces on for this test only: a tracer of a provider of our own (the global provider
    can be set once per process), spans exported as they end."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def _local_request_passes() -> list[PassRecord]:
    """A 40-token prompt in two chunks (the second shared with another sequence), then three
    decode steps in a batch of two."""
    return [PassRecord(10 * MS, 14 * MS, 32, 1, 32, False),
            PassRecord(15 * MS, 17 * MS, 8, 2, 9, False),
            *(PassRecord((20 + 5 * i) * MS, (23 + 5 * i) * MS, 1, 2, 2, True) for i in range(3))]


def test_a_local_prefill_gets_its_queue_chunks_and_steps(exported):
    parent = tracing.start_span("decode", kind="server")
    passes = _local_request_passes()
    trace_spans.queue_span("decode.queue", parent, 5 * MS, passes)
    trace_spans.chunk_spans(parent, passes)
    trace_spans.decode_steps_span(parent, passes)
    parent.end()
    spans = exported.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (queue,), chunks, (steps,) = by_name["decode.queue"], by_name["prefill.chunk"], by_name["decode.steps"]
    root = by_name["decode"][0].context.span_id
    assert all(s.parent.span_id == root for s in [queue, *chunks, steps])
    assert (queue.start_time, queue.end_time) == (5 * MS, 10 * MS)
    assert [(c.start_time, c.end_time, c.attributes["tandem.chunk_tokens"],
             c.attributes["tandem.batch_size"]) for c in chunks] == \
        [(10 * MS, 14 * MS, 32, 1), (15 * MS, 17 * MS, 8, 2)]
    assert (steps.start_time, steps.end_time) == (20 * MS, 33 * MS)
    assert steps.attributes["tandem.steps"] == 3 and steps.attributes["tandem.step_tokens"] == 3
    assert steps.attributes["tandem.batch_size_max"] == 2
    assert steps.attributes["tandem.step_ms_max"] == pytest.approx(3.0)
    assert [(e.name, e.timestamp, e.attributes["tandem.step_ms"]) for e in steps.events] == \
        [("step", (20 + 5 * i) * MS, pytest.approx(3.0)) for i in range(3)]


def test_a_failed_transfer_is_marked_and_has_only_the_stages_it_reached(exported):
    parent = tracing.start_span("prefill", kind="server")
    # Granted, two units out, none acknowledged, then the receiver went away: no finish.
    times = TransferTimes(asked_ns=1 * MS, granted_ns=2 * MS, first_unit_ns=3 * MS,
                          ended_ns=9 * MS, units=2)
    status = TransferStatus(TransferState.FAILED, "receiver unreachable: gone", times)
    trace_spans.kv_send_spans(parent, "t-1", status)
    parent.end()
    spans = {s.name: s for s in exported.get_finished_spans()}
    send = spans["kv.send"]
    assert send.status.status_code is StatusCode.ERROR and "gone" in send.status.description
    assert (send.start_time, send.end_time) == (1 * MS, 9 * MS)
    assert send.attributes == {"tandem.transfer_id": "t-1", "tandem.kv_units": 2}
    assert (spans["kv.grant"].start_time, spans["kv.grant"].end_time) == (1 * MS, 2 * MS)
    # No acknowledgement came: the layers' span runs to the end it met.
    assert (spans["kv.layers"].start_time, spans["kv.layers"].end_time) == (3 * MS, 9 * MS)
    assert "kv.finish" not in spans
    assert all(spans[n].parent.span_id == send.context.span_id for n in ("kv.grant", "kv.layers"))
    # A status with no times (the sender closed under it) makes no spans.
    exported.clear()
    trace_spans.kv_send_spans(parent, "t-2", TransferStatus(TransferState.FAILED, "closed"))
    assert exported.get_finished_spans() == ()


def test_nothing_is_made_while_traces_are_off(monkeypatch):
    monkeypatch.setattr(tracing, "_tracer", None)
    passes = _local_request_passes()
    assert tracing.span_between("x", None, 1, 2) is tracing.NO_SPAN
    trace_spans.queue_span("decode.queue", tracing.NO_SPAN, 0, passes)
    trace_spans.chunk_spans(tracing.NO_SPAN, passes)
    trace_spans.decode_steps_span(tracing.NO_SPAN, passes)
