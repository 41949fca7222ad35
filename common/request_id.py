"""The request id that ties one request's log lines together across the coordinator, the
prefill worker and the decode worker.

    client --X-Request-Id: R--> coordinator --gRPC metadata x-request-id: R--> workers
           <--X-Request-Id: R--

The coordinator takes the client's `X-Request-Id` when it is a valid one (printable ASCII
without spaces, at most MAX_LENGTH characters: it is written into every log line and echoed in
a header, so nothing that could forge a log line or a header gets through), else it makes one.
It is not the flow's internal request id, which names KV transfers and must be unique: two
clients may send the same X-Request-Id.

Each process keeps the id of the request it is serving in a context variable (`current`):
asyncio tasks and gRPC aio handlers copy the context, so every log line written while serving
that request carries it (common/log_format.py reads it). Torch-free.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

HEADER = "X-Request-Id"
METADATA_KEY = "x-request-id"  # gRPC metadata keys are lower-case
MAX_LENGTH = 128

current: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")


def valid(value: str | None) -> str | None:
    """`value` when it may serve as a request id (1..MAX_LENGTH visible ASCII characters), else
    None (the caller makes one)."""
    if not value or len(value) > MAX_LENGTH:
        return None
    return value if all("!" <= c <= "~" for c in value) else None


def new() -> str:
    return uuid.uuid4().hex


def accept(value: str | None) -> str:
    """The client's id when valid, else a new one."""
    return valid(value) or new()


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The id a gRPC caller sent (coordinator -> worker, or a client of the gRPC API), "" when
    none or an invalid one (a worker then logs without it rather than trust the value)."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            return valid(text) or ""
    return ""


def metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries `request_id` to a worker (empty when there is none)."""
    return ((METADATA_KEY, request_id),) if request_id else ()


def log_extra(log_id: str) -> dict[str, str]:
    """`extra=` for a log call about a request, made where the context does not carry its id
    (a worker's engine thread, which serves every request at once): the line gets `log_id`."""
    return {"request_id": log_id}


@contextmanager
def serving(request_id: str) -> Iterator[str]:
    """Log lines written inside carry `request_id` (restored on exit)."""
    token = current.set(request_id)
    try:
        yield request_id
    finally:
        current.reset(token)
