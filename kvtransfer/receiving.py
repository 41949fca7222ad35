r"""Receiver bookkeeping shared by every backend: who owns which blocks, what has arrived, and
the one path by which bytes reach the cache.

Threads: `ingest` runs on the backend's I/O thread; `expect`, `poll` and `cancel` on the engine
thread. One lock guards the table. The cache write happens under it, so once `cancel` (or the
poll that reports FAILED) returns, no write for that request is in progress or can start; the
engine thread may wait at most one payload's memcpy for it. Checksums are computed outside it.

Per request:

    expect() --> active --(all layers x blocks arrived)--> closed: COMPLETE event
                   |  \--(refused payload / deadline)-----> closed: FAILED event
                   \----(cancel)--------------------------> closed: no event
    payload for an id never expected -----------------------> closed: FAILED event

`closed` remembers recent outcomes (bounded) so a late payload gets a precise refusal.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .base import KVReceiver, ReceiveEvent, ReceiveKind
from .layout import KVCacheBuffer, KVLayout
from .message import Ack, KVHeader, MessageError, checksum, payload_tensor

CLOSED_MEMORY = 4096  # how many finished request ids to remember for late payloads


@dataclass
class _Expectation:
    block_ids: frozenset[int]
    ordered_blocks: tuple[int, ...]
    deadline: float  # time.monotonic()
    missing: list[set[int]]  # per layer, blocks not yet written
    missing_count: int = field(init=False)

    def __post_init__(self) -> None:
        self.missing_count = sum(len(m) for m in self.missing)


class ReceiveTable:
    def __init__(
        self,
        cache: KVCacheBuffer,
        layout: KVLayout,
        on_claim: Callable[[str, tuple[int, ...]], None] | None = None,
        on_release: Callable[[tuple[int, ...]], None] | None = None,
    ) -> None:
        if cache.layout != layout:
            raise ValueError(f"cache layout differs from receiver layout: {cache.layout.diff(layout)}")
        self.cache = cache
        self.layout = layout
        self._on_claim = on_claim  # shm: publish block ownership to senders
        self._on_release = on_release
        self._lock = threading.Lock()
        self._active: dict[str, _Expectation] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # request id -> outcome
        self._events: list[ReceiveEvent] = []
        self.undecodable = 0  # messages dropped for want of a readable header (a metric)
        self.last_undecodable = ""

    # -- engine thread ----------------------------------------------------------------------

    def expect(
        self, request_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float
    ) -> None:
        blocks = tuple(int(b) for b in block_ids)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not blocks:
            raise ValueError(f"{request_id}: block_ids is empty")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"{request_id}: duplicate block ids in {list(blocks)}")
        bad = [b for b in blocks if not 0 <= b < self.cache.num_blocks]
        if bad:
            raise ValueError(f"{request_id}: block ids {bad} out of range [0, {self.cache.num_blocks})")
        if not 1 <= num_layers <= self.layout.num_layers:
            raise ValueError(f"{request_id}: num_layers {num_layers} not in [1, {self.layout.num_layers}]")
        if not deadline_s > 0:
            raise ValueError(f"{request_id}: deadline_s must be > 0, got {deadline_s!r}")
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"{request_id}: already expected")
            mine = set(blocks)
            for other_id, other in self._active.items():
                if mine & other.block_ids:
                    raise ValueError(
                        f"{request_id}: blocks {sorted(mine & other.block_ids)} already expected by {other_id}"
                    )
            self._closed.pop(request_id, None)
            self._active[request_id] = _Expectation(
                frozenset(blocks), blocks, time.monotonic() + deadline_s,
                [set(blocks) for _ in range(num_layers)],
            )
            if self._on_claim is not None:
                self._on_claim(request_id, blocks)

    def poll(self) -> list[ReceiveEvent]:
        now = time.monotonic()
        with self._lock:
            for rid, exp in list(self._active.items()):
                if now > exp.deadline:
                    done = sum(1 for m in exp.missing if not m)
                    self._close(rid, ReceiveKind.FAILED,
                                f"deadline passed with {done}/{len(exp.missing)} layers complete")
            events, self._events = self._events, []
        return events

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._active:
                self._close(request_id, None, "cancelled")

    # -- I/O thread -------------------------------------------------------------------------

    def ingest(self, header: KVHeader, data: bytes | bytearray | memoryview | None) -> Ack:
        """Validate one payload and write it into the cache; the returned Ack goes to the sender.

        data=None means the sender already wrote the blocks in place (shm): verify them instead.
        """
        with self._lock:
            refusal = self._admit(header)
        if refusal is not None:
            return self._nack(header, refusal)
        payload: torch.Tensor | None = None
        if header.sender_error:
            return self._refuse(header, f"sender did not write: {header.sender_error}")
        try:
            if data is None:
                idx = torch.tensor(header.block_ids, dtype=torch.long)
                actual = checksum(self.cache.tensor[header.layer].index_select(1, idx))
            else:
                payload = payload_tensor(header, data)
                actual = checksum(data)
        except MessageError as e:
            return self._refuse(header, str(e))
        if actual != header.checksum:
            return self._refuse(
                header, f"checksum mismatch on layer {header.layer}: "
                f"got {actual:#010x}, header says {header.checksum:#010x}"
            )
        with self._lock:
            refusal = self._admit(header)  # cancelled or failed while we were checksumming?
            if refusal is not None:
                return self._nack(header, refusal)
            exp = self._active[header.request_id]
            if payload is not None:
                idx = torch.tensor(header.block_ids, dtype=torch.long)
                self.cache.tensor[header.layer].index_copy_(1, idx, payload)
            missing = exp.missing[header.layer] if header.layer < len(exp.missing) else set()
            exp.missing_count -= len(missing & set(header.block_ids))
            missing.difference_update(header.block_ids)
            if exp.missing_count == 0:
                self._close(header.request_id, ReceiveKind.COMPLETE, "")
        return Ack(header.seq, header.request_id, header.layer, True)

    def refuse_undecodable(self, reason: str) -> None:
        """A message with no usable header: nobody to blame, nothing to ack."""
        with self._lock:
            self.undecodable += 1
            self.last_undecodable = reason

    # -- internals (lock held unless noted) ---------------------------------------------------

    def _admit(self, header: KVHeader) -> str | None:
        rid = header.request_id
        exp = self._active.get(rid)
        if exp is None:
            if rid in self._closed:
                return f"request {rid} already {self._closed[rid]}"
            reason = f"unexpected request {rid}"
            self._remember(rid, f"failed: {reason}")
            self._events.append(ReceiveEvent(rid, ReceiveKind.FAILED, reason))
            return reason
        try:
            header.check_against(self.layout, self.cache.num_blocks)
        except MessageError as e:
            return self._fail_locked(rid, str(e))
        foreign = [b for b in header.block_ids if b not in exp.block_ids]
        if foreign:
            return self._fail_locked(rid, f"blocks {foreign} are not owned by request {rid}")
        if header.layer >= len(exp.missing):
            return self._fail_locked(rid, f"layer {header.layer} beyond the {len(exp.missing)} expected")
        return None

    def _refuse(self, header: KVHeader, reason: str) -> Ack:
        """Fail the request for a payload that passed admission but not the checks (no lock)."""
        with self._lock:
            if header.request_id in self._active:
                self._fail_locked(header.request_id, reason)
        return self._nack(header, reason)

    def _nack(self, header: KVHeader, reason: str) -> Ack:
        return Ack(header.seq, header.request_id, header.layer, False, reason)

    def _fail_locked(self, rid: str, reason: str) -> str:
        self._close(rid, ReceiveKind.FAILED, reason)
        return reason

    def _close(self, rid: str, kind: ReceiveKind | None, reason: str) -> None:
        exp = self._active.pop(rid)
        if self._on_release is not None:
            self._on_release(exp.ordered_blocks)
        if kind is None:
            self._remember(rid, "cancelled")
        else:
            self._events.append(ReceiveEvent(rid, kind, reason))
            self._remember(rid, "complete" if kind is ReceiveKind.COMPLETE else f"failed: {reason}")

    def _remember(self, rid: str, outcome: str) -> None:
        self._closed[rid] = outcome
        self._closed.move_to_end(rid)
        while len(self._closed) > CLOSED_MEMORY:
            self._closed.popitem(last=False)


class TableReceiver(KVReceiver):
    """A receiver whose bookkeeping is a ReceiveTable (`self.table`) and whose address is
    `self._endpoint`: the engine-facing half of the contract, shared by every backend; each
    backend adds only its transport (and close())."""

    table: ReceiveTable
    _endpoint: str

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def expect(self, request_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        self.table.expect(request_id, block_ids, num_layers, deadline_s)

    def poll(self) -> list[ReceiveEvent]:
        return self.table.poll()

    def cancel(self, request_id: str) -> None:
        self.table.cancel(request_id)
