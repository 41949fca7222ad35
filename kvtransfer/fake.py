"""In-process transport: the sender calls straight into the receiver, on the caller's thread.

Serves unit tests, warm-up and the quick start (one process, no sockets). Endpoints are
"fake://<n>", valid only inside the process that created the receiver.

Faults for tests are configured on the sender's constructor, so nothing else carries a hook:

    FakeSender(faults=[FakeFault("corrupt", request_id="r1", layer=2)])

kinds: "corrupt" (flip one payload byte after the checksum is taken), "fingerprint" (claim
another layout), "drop" (never deliver: the sender's ack deadline fires), "delay" (deliver
delay_s later, on a later send()/poll() of this sender: still synchronous, just late).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .base import KVTransferError, TransferStatus
from .layout import KVCacheBuffer, KVLayout
from .message import KVHeader, tensor_bytes
from .receiving import ReceiveTable, TableReceiver
from .sending import TrackedSender

_RECEIVERS: dict[str, FakeReceiver] = {}
_REGISTRY_LOCK = threading.Lock()
_IDS = itertools.count()

FAULT_KINDS = ("corrupt", "fingerprint", "drop", "delay")


@dataclass(frozen=True)
class FakeFault:
    kind: str  # one of FAULT_KINDS
    request_id: str | None = None  # None: every request
    layer: int | None = None  # None: every layer
    delay_s: float = 0.0  # "delay" only

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FakeFault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.kind == "delay" and not self.delay_s > 0:
            raise ValueError(f"a delay fault needs delay_s > 0, got {self.delay_s!r}")

    def matches(self, request_id: str, layer: int) -> bool:
        return self.request_id in (None, request_id) and self.layer in (None, layer)


class FakeReceiver(TableReceiver):
    def __init__(self, cache: KVCacheBuffer, layout: KVLayout) -> None:
        self.cache, self.layout = cache, layout
        self.table = ReceiveTable(cache, layout)
        self._endpoint = f"fake://{next(_IDS)}"
        with _REGISTRY_LOCK:
            _RECEIVERS[self._endpoint] = self

    def close(self) -> None:
        with _REGISTRY_LOCK:
            _RECEIVERS.pop(self._endpoint, None)


class FakeSender(TrackedSender):
    def __init__(
        self, faults: Sequence[FakeFault] = (), ack_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s)
        self.faults = tuple(faults)
        self._peer: FakeReceiver | None = None
        self._delayed: list[tuple[float, KVHeader, bytes]] = []  # (due, header, data)

    def connect(self, endpoint: str, layout: KVLayout) -> None:
        with _REGISTRY_LOCK:
            peer = _RECEIVERS.get(endpoint)
        if peer is None:
            raise KVTransferError(f"no fake receiver at {endpoint} in this process")
        self._check_layout(layout, peer.layout, endpoint)
        self._peer, self.layout = peer, layout

    def send(self, request_id: str, layer: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        header, payload = self._prepare(request_id, layer, block_ids, payload)
        data = bytes(tensor_bytes(payload))
        due = time.monotonic()
        for fault in self.faults:
            if not fault.matches(request_id, layer):
                continue
            if fault.kind == "drop":
                return
            if fault.kind == "corrupt":
                data = bytes([data[0] ^ 0x01]) + data[1:]
            elif fault.kind == "fingerprint":
                header = replace(header, fingerprint="0" * len(header.fingerprint))
            elif fault.kind == "delay":
                due += fault.delay_s
        self._delayed.append((due, header, data))
        self._deliver_due()

    def poll(self, request_id: str) -> TransferStatus:
        self._deliver_due()
        return super().poll(request_id)

    def close(self) -> None:
        self.closed = True
        self._peer = None
        self._delayed.clear()

    def _deliver_due(self) -> None:
        if self._peer is None:
            return
        now = time.monotonic()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, header, data in due:
            self.tracker.on_ack(self._peer.table.ingest(header, data))
