"""The KV transfer contract: a prefill worker's `KVSender` pushes KV blocks into a decode
worker's `KVReceiver`. Every backend (fake, zmq, shm, grpc, dist) implements exactly this,
on top of the shared halves: sender.py (engine thread), sender_io.py (its I/O thread's state
machine) and sender_hooks.py (what a sender backend adds); receiver.py (engine thread),
receive_table.py (the receiver's state machine) and receiver_hooks.py (what a receiver backend
adds). transfer.py holds the per-transfer records a backend sees.

Who calls what (modelled on vLLM v1's KVConnectorBase_V1 and SGLang's disaggregation base).
A transfer is named by a transfer id that the coordinator gives both sides at once; neither
waits for the other before starting: the decode worker reserves blocks and `expect`s, the
prefill worker computes and `send`s, and the grant (which destination blocks, how many leading
blocks the receiver already holds) travels from receiver to sender over the backend's own
control channel. Block indices in `send` are positions in the request's block sequence
(0 = the block holding prompt tokens 0..block_size-1), so a sender can start before it knows
the destination.

KVSender -- prefill side only; one instance per receiver endpoint. The methods below are called
from the prefill worker's engine thread (connect/close from any one thread); all I/O (waiting
for the grant, gathering blocks out of the source cache, checksums, transmission, acks) runs on
the sender's own I/O thread, so none of them waits on the network or copies KV.
  connect(endpoint, layout)    once, before any send. Handshakes: fetches the receiver's layout
                               and raises KVLayoutMismatch if the fingerprints differ (nothing is
                               ever sent across a mismatch). Blocks for at most the constructor's
                               connect_timeout_s (KVTransferError on expiry); never call it on
                               the step loop.
  send(transfer_id, layer, first_block, source, src_block_ids)
                               once per (transfer, layer, chunk), right after that layer's KV is
                               written, as often as layers x chunks. `source` is the caller's
                               cache for that layer, [2, num_blocks, block_size, heads, head_dim];
                               `src_block_ids` are the blocks of it holding the transfer's blocks
                               first_block, first_block + 1, ... The I/O thread reads them later:
                               the caller must neither write nor free those blocks until poll()
                               reports a terminal status. Blocks below the grant's skip_blocks
                               are not sent (the receiver has them from its prefix cache).
  finish(transfer_id, first_token)
                               once, after the transfer's last send(): the first token travels
                               with the last layer's KV, and the receiver reports COMPLETE only
                               when every granted block of every layer and this have arrived.
  abort(transfer_id, reason)   at most once, instead of (or after) finish, when the prefill
                               failed or was cancelled: units not yet transmitted are dropped and
                               the receiver is told (it fails the request). Idempotent.
  poll(transfer_id) -> TransferStatus
                               every step while the transfer is open. IN_FLIGHT; DONE (finish and
                               every unit acknowledged); FAILED with a reason (refused unit, no
                               grant or no ack within ack_timeout_s, receiver gone, aborted).
                               Terminal only once the I/O thread will read `source` no more, so
                               the caller may free the source blocks at once. Reported once; the
                               id is then forgotten and polling it again raises KeyError.
  stats() -> TransferStats     counters for metrics, from any thread.
  failed_peer -> str           non-empty once the receiver is known dead or unreachable (the
                               connection itself failed, not one transfer): the owner should
                               close this sender and connect a new one.
  close()                      once, at shutdown. Idempotent; open transfers become FAILED.

KVReceiver -- decode side only; created with the worker's KVCacheBuffer and layout; its I/O
runs on a background thread (the fake's inside the sender's thread), so the engine thread only
calls these, none of which waits on the network:
  endpoint                     read once and handed to prefill workers via the control plane.
  expect(transfer_id, block_ids, num_layers, deadline_s, skip_blocks=0)
                               once per transfer, after the block manager reserved `block_ids`
                               for the request's blocks skip_blocks, skip_blocks + 1, ... (the
                               ones before are prefix-cache hits; block_ids may be empty when
                               every block is cached). Grants them to the sender that asks for
                               this transfer id (now or later). The request is complete when
                               every one of layers [0, num_layers) has arrived for every one of
                               `block_ids`, and the sender's finish. ValueError on a bad
                               argument or a duplicate id.
  poll() -> list[ReceiveEvent] every step. Each expected transfer yields exactly one of
                               COMPLETE (with the first token) or FAILED (refused unit, sender
                               abort, deadline_s passed); and every one that did not COMPLETE
                               (FAILED or cancelled) then yields exactly one RELEASED: from then
                               on no sender can write into its blocks, and only then may the
                               engine reuse them. Payloads for an unknown transfer are refused.
  cancel(transfer_id)          on abort. Later payloads for it are dropped; no COMPLETE or
                               FAILED follows, only the RELEASED.
  stats() -> TransferStats     counters for metrics, from any thread.
  close()                      once, at shutdown. Idempotent.

Invariants every receiver keeps:
- A payload is validated (expected transfer, blocks it was granted, fingerprint, dtype, shape,
  length, checksum) before a byte of it reaches the cache; a refused payload fails its
  transfer only.
- Block reuse only when no writer remains: RELEASED is reported only when nothing can write
  into the transfer's blocks again. Where the receiver does every write itself (fake, zmq,
  grpc, dist) that is at once, under its table lock. Where the sender writes into the cache directly
  (shm), only after the sender acknowledged the revocation from its writer thread (its writes
  are ordered with that ack) or its process is gone; never on a timer.
- COMPLETE means every granted block of every layer and the finish have arrived; no write for
  that transfer follows.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .errors import KVLayoutMismatch, KVTransferError  # noqa: F401 (defined there, exported here)
from .layout import KVCacheBuffer, KVLayout


class TransferState(enum.Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferTimes:
    """When a sent transfer reached each stage: wall-clock ns (time.time_ns, what trace spans
    are stamped with); 0 for a stage it never reached. The sender's I/O thread takes them."""

    asked_ns: int = 0  # the grant was asked for
    granted_ns: int = 0  # the grant came
    first_unit_ns: int = 0  # the first data unit went out
    last_ack_ns: int = 0  # the last data unit was acknowledged
    finish_ns: int = 0  # the finish unit went out
    ended_ns: int = 0  # the transfer became terminal
    units: int = 0  # data units sent


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""  # why it failed; empty otherwise
    # A sender's terminal status: when it reached each stage (None: in flight, or a receiver's)
    times: TransferTimes | None = field(default=None, compare=False)

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED


class ReceiveKind(enum.Enum):
    COMPLETE = "complete"
    FAILED = "failed"
    RELEASED = "released"  # no writer remains: the blocks of a failed/cancelled transfer are free to reuse


@dataclass(frozen=True)
class ReceiveEvent:
    request_id: str  # the transfer id
    kind: ReceiveKind
    reason: str = ""  # why it failed; empty otherwise
    first_token: int | None = None  # COMPLETE: the token the prefill worker sampled


@dataclass(frozen=True)
class TransferStats:
    """Monotonic counters of one sender or receiver (Prometheus counters downstream)."""

    backend: str
    bytes: int = 0  # payload bytes sent (sender) or written into the cache (receiver)
    units: int = 0  # data units sent / accepted
    transfers_done: int = 0  # DONE (sender) / COMPLETE (receiver)
    transfers_failed: int = 0
    seconds: float = 0.0  # sum over finished transfers of first send (or expect) -> terminal
    skipped_blocks: int = 0  # blocks not sent because the receiver had them cached (grant skip)
    # Receiver: units, grant requests and handshakes refused for want of the cluster's
    # credentials (bad or missing token, failed CURVE handshake; kvtransfer/auth.py).
    auth_rejected: int = 0


class KVSender(ABC):
    """Prefill side. See the module docstring for who calls each method and when."""

    @abstractmethod
    def connect(self, endpoint: str, layout: KVLayout) -> None: ...

    @abstractmethod
    def send(
        self, transfer_id: str, layer: int, first_block: int, source: torch.Tensor,
        src_block_ids: Sequence[int],
    ) -> None: ...

    @abstractmethod
    def finish(self, transfer_id: str, first_token: int) -> None: ...

    @abstractmethod
    def abort(self, transfer_id: str, reason: str) -> None: ...

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferStatus: ...

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @property
    @abstractmethod
    def failed_peer(self) -> str: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side. See the module docstring for who calls each method and when."""

    cache: KVCacheBuffer
    layout: KVLayout

    @property
    @abstractmethod
    def endpoint(self) -> str: ...

    @abstractmethod
    def expect(
        self, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float,
        skip_blocks: int = 0,
    ) -> None: ...

    @abstractmethod
    def poll(self) -> list[ReceiveEvent]: ...

    @abstractmethod
    def cancel(self, transfer_id: str) -> None: ...

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
