"""Sender bookkeeping shared by every backend: sequence numbers, in-flight units, acks, and the
ack deadline that turns a dead receiver into FAILED instead of a hang.

Every send() is one unit with its own deadline (sent_at + ack_timeout_s on the monotonic
clock). A request is DONE when it has sent at least one unit and none is unacknowledged; FAILED
on the first refusal or expired unit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import KVLayoutMismatch, KVSender, KVTransferError, TransferState, TransferStatus
from .layout import KVLayout
from .message import Ack, KVHeader


@dataclass
class _Request:
    inflight: dict[int, tuple[int, float]] = field(default_factory=dict)  # seq -> (layer, deadline)
    failure: str = ""


class SendTracker:
    """Thread-safe: acks may arrive on a transport's callback thread."""

    def __init__(self, ack_timeout_s: float) -> None:
        if not ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s must be > 0, got {ack_timeout_s!r}")
        self.ack_timeout_s = ack_timeout_s
        self._lock = threading.Lock()
        self._seq = 0
        self._requests: dict[str, _Request] = {}

    def start(self, request_id: str, layer: int) -> int:
        """Register a unit about to be sent; returns its sequence number."""
        with self._lock:
            self._seq += 1
            req = self._requests.setdefault(request_id, _Request())
            req.inflight[self._seq] = (layer, time.monotonic() + self.ack_timeout_s)
            return self._seq

    def on_ack(self, ack: Ack) -> None:
        with self._lock:
            req = self._requests.get(ack.request_id)
            if req is None or req.inflight.pop(ack.seq, None) is None:
                return  # a request already reported and forgotten
            if not ack.ok and not req.failure:
                req.failure = f"receiver refused layer {ack.layer}: {ack.reason}"

    def fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            req = self._requests.setdefault(request_id, _Request())
            req.failure = req.failure or reason

    def fail_all(self, reason: str) -> None:
        with self._lock:
            for req in self._requests.values():
                req.failure = req.failure or reason

    def poll(self, request_id: str) -> TransferStatus:
        now = time.monotonic()
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise KeyError(f"unknown request {request_id!r} (never sent, or already reported)")
            if not req.failure:
                late = sorted(layer for layer, deadline in req.inflight.values() if now > deadline)
                if late:
                    req.failure = (
                        f"no ack for layers {late} within {self.ack_timeout_s}s "
                        "(receiver dead or unreachable?)"
                    )
            if req.failure:
                del self._requests[request_id]
                return TransferStatus(TransferState.FAILED, req.failure)
            if not req.inflight:
                del self._requests[request_id]
                return TransferStatus(TransferState.DONE)
            return TransferStatus(TransferState.IN_FLIGHT)


class TrackedSender(KVSender):
    """Argument checks and bookkeeping common to every backend's sender."""

    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        if not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s!r}")
        self.tracker = SendTracker(ack_timeout_s)
        self.connect_timeout_s = connect_timeout_s
        self.layout: KVLayout | None = None
        self.closed = False

    def _prepare(
        self, request_id: str, layer: int, block_ids: Sequence[int], payload: torch.Tensor
    ) -> tuple[KVHeader, torch.Tensor]:
        """Check the caller's arguments, take the payload, register the unit, build its header."""
        if self.closed:
            raise KVTransferError("sender is closed")
        layout = self.layout
        if layout is None:
            raise KVTransferError("send() before connect()")
        blocks = tuple(int(b) for b in block_ids)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not 0 <= layer < layout.num_layers:
            raise ValueError(f"{request_id}: layer {layer} not in [0, {layout.num_layers})")
        if not blocks:
            raise ValueError(f"{request_id}: block_ids is empty")
        if payload.dtype != layout.torch_dtype:
            raise ValueError(f"{request_id}: payload dtype {payload.dtype} != layout {layout.dtype}")
        if tuple(payload.shape) != layout.payload_shape(len(blocks)):
            raise ValueError(
                f"{request_id}: payload shape {list(payload.shape)} != "
                f"{list(layout.payload_shape(len(blocks)))} for {len(blocks)} blocks"
            )
        payload = payload.detach().cpu().contiguous()  # no copy for a contiguous CPU tensor
        seq = self.tracker.start(request_id, layer)
        return KVHeader.for_payload(request_id, layer, blocks, payload, layout, seq), payload

    def _check_layout(self, ours: KVLayout, theirs: KVLayout, endpoint: str) -> None:
        if ours.fingerprint != theirs.fingerprint:
            diff = "; ".join(ours.diff(theirs))
            raise KVLayoutMismatch(f"receiver at {endpoint} has another KV layout (ours != theirs): {diff}")

    def poll(self, request_id: str) -> TransferStatus:
        return self.tracker.poll(request_id)
