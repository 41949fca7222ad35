"""A request's part in a KV transfer: the state beside its scheduling status, and what it
carries into an engine that transfers its KV. The state diagram and who moves it is in
engine/kv_connector.py; the state lives on the Request (engine/request.py). Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class KVTransferState(enum.Enum):
    """A request's part in a KV transfer, beside its scheduling status."""

    NONE = "none"  # no transfer (local prefill, colocated)
    RECEIVING = "receiving"  # decode: blocks reserved and granted, KV landing
    RECEIVED = "received"  # decode: every block of every layer and the first token arrived
    SENDING = "sending"  # prefill: layers handed to the sender, not all acknowledged
    DRAINING = "draining"  # ended; a transfer may still touch its blocks, which stay held
    RELEASED = "released"  # ended; no transfer touches its blocks any more


@dataclass(frozen=True)
class KVTransferParams:
    """What a request carries into an engine that transfers its KV."""

    transfer_id: str  # the same on both workers; the coordinator names it
    remote_prefill: bool = False  # decode: the prompt's KV comes from a prefill worker
    peer: Any = None  # prefill: the connector's handle for the destination (a connected sender)
    trace: Any = None  # prefill, traces on: the span the transfer's spans hang under
