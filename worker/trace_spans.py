"""A worker's finer trace spans, built after the fact from times the engine and KV-transfer
threads took (those threads never touch OpenTelemetry; common/tracing.py is off by default):

    prefill (server span, prefill_node/server.py)
    ├─ prefill.queue     the call's arrival -> its first pass (grammar compile, waiting for room)
    ├─ prefill.chunk     one per forward pass that computed part of the prompt
    └─ kv.send           the transfer, from asking for the grant until it ended (ok or failed)
       ├─ kv.grant       asked -> granted (the decode worker reserved its blocks)
       ├─ kv.layers      first data unit out -> last one acknowledged
       └─ kv.finish      finish unit out -> acknowledged (the decode worker has it all)
    decode (server span, decode_node/server.py)
    ├─ decode.queue      a local prefill: the call's arrival -> its first pass
    ├─ prefill.chunk     a local prefill's passes
    └─ decode.steps      first decode step -> last: a step per event (the SDK keeps the
                         first OTEL_SPAN_EVENT_COUNT_LIMIT, 128 by default), totals as attributes

A PassRecord (engine/pass_record.py) is one pass; TransferTimes (kvtransfer/base.py) one
transfer's stages.
"""

from __future__ import annotations

from collections.abc import Sequence

from common import tracing
from engine.pass_record import PassRecord


def queue_span(name: str, parent, arrived_ns: int, passes: Sequence[PassRecord]) -> None:
    """`name` from the call's arrival to its first pass (none when no pass ran)."""
    if passes:
        tracing.span_between(name, parent, arrived_ns, passes[0].start_ns)


def chunk_spans(parent, passes: Sequence[PassRecord]) -> None:
    """A prefill.chunk span for each pass that computed prompt tokens."""
    for p in passes:
        if not p.decode:
            tracing.span_between("prefill.chunk", parent, p.start_ns, p.end_ns, {
                "tandem.chunk_tokens": p.tokens, "tandem.batch_size": p.batch_size,
                "tandem.batch_tokens": p.batch_tokens})


def decode_steps_span(parent, passes: Sequence[PassRecord]) -> None:
    """One decode.steps span over the decode passes, each an event."""
    steps = [p for p in passes if p.decode]
    if not steps:
        return
    longest = max(p.end_ns - p.start_ns for p in steps)
    tracing.span_between("decode.steps", parent, steps[0].start_ns, steps[-1].end_ns, {
        "tandem.steps": len(steps), "tandem.step_tokens": sum(p.tokens for p in steps),
        "tandem.batch_size_max": max(p.batch_size for p in steps),
        "tandem.batch_size_mean": sum(p.batch_size for p in steps) / len(steps),
        "tandem.step_ms_max": longest / 1e6,
    }, events=[("step", p.start_ns, {"tandem.batch_size": p.batch_size,
                                     "tandem.step_ms": (p.end_ns - p.start_ns) / 1e6,
                                     "tandem.tokens": p.tokens}) for p in steps])


def kv_send_spans(parent, transfer_id: str, status) -> None:
    """kv.send and its stages for a sent transfer's terminal `status` (kvtransfer's
    TransferStatus; its `times` None when it ended without the I/O thread, e.g. closed)."""
    times = status.times
    if times is None or not times.asked_ns:
        return
    error = status.reason if status.failed else ""
    send = tracing.span_between("kv.send", parent, times.asked_ns, times.ended_ns, {
        "tandem.transfer_id": transfer_id, "tandem.kv_units": times.units}, error=error)
    stages = (("kv.grant", times.asked_ns, times.granted_ns),
              ("kv.layers", times.first_unit_ns, times.last_ack_ns or times.ended_ns),
              ("kv.finish", times.finish_ns, times.ended_ns))
    for name, start, end in stages:
        if start:
            tracing.span_between(name, send, start, end or times.ended_ns)
