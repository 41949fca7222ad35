"""Whose cancellation a grpc.aio call's asyncio.CancelledError is.

A coordinator call to a worker raises CancelledError in two cases:
- the task awaiting it is being cancelled (the client left, a deadline);
- the call's channel was closed under it: the registry retired the channel of a worker that
  registered again, or closed the channel of one it declared dead for its silence
  (coordinator/registry.py).
The first must propagate; the second is a failure of that worker, which callers answer by
moving the request, trying another worker, or counting the probe unanswered.
"""

from __future__ import annotations

import asyncio


def cancelled_from_outside() -> bool:
    """Whether the running task itself is being cancelled, as opposed to a gRPC call that
    grpc.aio ended with CancelledError because its channel closed."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; before it, assume ours
    return cancelling is None or cancelling() > 0
