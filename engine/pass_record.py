"""What one forward pass did for one traced request: the worker turns a request's records into
its trace spans (prefill chunks, decode steps; worker/pass_spans.py). Torch-free.

Times are wall-clock nanoseconds (time.time_ns), what OpenTelemetry stamps spans with, taken
once per pass for every traced request in it; the engine appends a record only to requests
whose `passes` list the worker set, so an untraced request costs one attribute test a pass.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PassRecord:
    start_ns: int  # before the pass ran
    end_ns: int  # after its tokens were sampled and the scheduler updated
    tokens: int  # this request's tokens computed in the pass (drafts included)
    batch_size: int  # sequences in the pass
    batch_tokens: int  # tokens in the pass, all sequences
    decode: bool  # the request's chunk was at or past its first generated token
