"""In-process transport: the sender's I/O thread calls straight into the receiver's table.

Serves unit tests, warm-up and the quick start (one process, no sockets). Endpoints are
"fake://<n>", valid only inside the process that created the receiver. The protocol is the
real one (grant, units, finish/abort, revocation), with function calls for messages: a grant
or revocation given on the receiver's engine thread is posted into the sender's inbox.

Faults for tests are configured on the sender's constructor, so nothing else carries a hook:

    FakeSender(faults=[FakeFault("corrupt", transfer_id="r1", layer=2)])

kinds (a data unit matches transfer_id and layer; None matches all):
  "corrupt"      flip one payload byte after the checksum is taken (the receiver refuses it)
  "fingerprint"  claim another layout (the receiver refuses it)
  "drop"         never deliver the unit: the sender's ack deadline fires
  "delay"        deliver it delay_s later, without holding up other units (finish may
                 overtake it: the receiver must cope with out-of-order units)
  "slow"         sleep delay_s on the sender's I/O thread before delivering each unit, so a
                 transfer visibly overlaps whatever the engine thread does meanwhile
  "no_grant"     never ask for the transfer's grant: it fails after ack_timeout_s
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .base import KVTransferError
from .layout import KVCacheBuffer, KVLayout
from .message import Grant, KVHeader, Revoke, tensor_bytes
from .receive_table import ReceiveTable
from .receiver import TableReceiver
from .sender import IOSender
from .transfer import OutgoingTransfer

_RECEIVERS: dict[str, FakeReceiver] = {}
_REGISTRY_LOCK = threading.Lock()
_IDS = itertools.count()

FAULT_KINDS = ("corrupt", "fingerprint", "drop", "delay", "slow", "no_grant")


@dataclass(frozen=True)
class FakeFault:
    kind: str  # one of FAULT_KINDS
    transfer_id: str | None = None  # None: every transfer
    layer: int | None = None  # None: every layer (data faults only)
    delay_s: float = 0.0  # "delay" and "slow"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FakeFault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.kind in ("delay", "slow") and not self.delay_s > 0:
            raise ValueError(f"a {self.kind} fault needs delay_s > 0, got {self.delay_s!r}")

    def matches(self, transfer_id: str, layer: int | None = None) -> bool:
        return self.transfer_id in (None, transfer_id) and (layer is None or self.layer in (None, layer))


class FakeReceiver(TableReceiver):
    def __init__(self, cache: KVCacheBuffer, layout: KVLayout) -> None:
        self.cache, self.layout = cache, layout
        self.table = ReceiveTable(cache, layout, self._deliver, "fake")
        self._senders: dict[str, FakeSender] = {}
        self._senders_lock = threading.Lock()
        self.closed = False
        self._endpoint = f"fake://{next(_IDS)}"
        with _REGISTRY_LOCK:
            _RECEIVERS[self._endpoint] = self

    def attach(self, sender: FakeSender) -> None:
        with self._senders_lock:
            self._senders[sender.sender_id] = sender

    def detach(self, sender: FakeSender) -> None:
        with self._senders_lock:
            self._senders.pop(sender.sender_id, None)

    def _deliver(self, sender_id: str, message: Grant | Revoke) -> None:
        with self._senders_lock:
            sender = self._senders.get(sender_id)
        if sender is not None:
            sender.io.post(("grant" if isinstance(message, Grant) else "revoke", message))

    def close(self) -> None:
        self.closed = True
        with _REGISTRY_LOCK:
            _RECEIVERS.pop(self._endpoint, None)


class FakeSender(IOSender):
    backend = "fake"

    def __init__(
        self, faults: Sequence[FakeFault] = (), ack_timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s)
        self.faults = tuple(faults)
        self._peer: FakeReceiver | None = None
        self._delayed: list[tuple[float, KVHeader, bytes]] = []  # (due, header, data); I/O thread

    def _handshake(self, endpoint: str, layout: KVLayout) -> None:
        with _REGISTRY_LOCK:
            peer = _RECEIVERS.get(endpoint)
        if peer is None:
            raise KVTransferError(f"no fake receiver at {endpoint} in this process")
        self._check_layout(layout, peer.layout, endpoint)
        peer.attach(self)
        peer.table.register_sender(self._handshake_request(layout))
        self._peer = peer

    def _live_peer(self) -> FakeReceiver | None:
        peer = self._peer
        if peer is None or peer.closed:
            self.io.peer_failed(f"fake receiver at {self.endpoint} closed")
            return None
        return peer

    def _io_ask(self, t: OutgoingTransfer) -> None:
        if any(f.kind == "no_grant" and f.matches(t.transfer_id) for f in self.faults):
            return
        if (peer := self._live_peer()) is not None:
            peer.table.ask(self.sender_id, t.transfer_id)  # the grant comes through the inbox

    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        (source,) = sources  # one layer a unit: this transport keeps _io_unit_layers' 1
        payload = self.gather(source, src_ids)
        header = self.data_header(t, layer, dst_ids, payload, seq)
        data = bytes(tensor_bytes(payload))
        due = time.monotonic()
        for fault in self.faults:
            if not fault.matches(t.transfer_id, layer):
                continue
            if fault.kind == "drop":
                return ""
            if fault.kind == "corrupt":
                data = bytes([data[0] ^ 0x01]) + data[1:]
            elif fault.kind == "fingerprint":
                header = replace(header, fingerprint="0" * len(header.fingerprint))
            elif fault.kind == "delay":
                due += fault.delay_s
            elif fault.kind == "slow":
                time.sleep(fault.delay_s)
        if due > time.monotonic():
            self._delayed.append((due, header, data))
        elif (peer := self._live_peer()) is not None:
            self.io.on_ack(peer.table.ingest(header, data))
        return ""

    def _io_control(self, t: OutgoingTransfer, header: KVHeader) -> None:
        if (peer := self._live_peer()) is not None:
            ack = peer.table.control(header)
            if ack is not None:
                self.io.on_ack(ack)

    def _io_revoked(self, transfer_id: str) -> None:
        if (peer := self._live_peer()) is not None:
            peer.table.revoked(self.sender_id, transfer_id)

    def _io_tick(self, now: float) -> None:
        due = [d for d in self._delayed if d[0] <= now]
        if not due:
            return
        self._delayed = [d for d in self._delayed if d[0] > now]
        peer = self._live_peer()
        for _, header, data in due:
            if peer is not None:
                self.io.on_ack(peer.table.ingest(header, data))

    def _io_next_due(self) -> float | None:
        return min((d[0] for d in self._delayed), default=None)

    def _io_close(self) -> None:
        self._delayed.clear()
        peer, self._peer = self._peer, None
        if peer is not None:
            peer.table.sender_gone(self.sender_id, "sender closed")
            peer.detach(self)


__all__ = ["FAULT_KINDS", "FakeFault", "FakeReceiver", "FakeSender"]
