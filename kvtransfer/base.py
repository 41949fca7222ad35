"""The KV transfer contract: a prefill worker's `KVSender` pushes KV blocks into a decode
worker's `KVReceiver`. Every backend (fake, zmq, shm, grpc) implements exactly this.

Who calls what (modelled on vLLM's KVConnectorBase_V1 and SGLang's disaggregation base):

KVSender -- prefill side only; one instance per receiver endpoint; all methods from the prefill
worker's engine thread (a sender is not thread-safe).
  connect(endpoint, layout)    once, at setup or when a new decode worker appears, before any
                               send. Handshakes: fetches the receiver's layout and raises
                               KVLayoutMismatch if the fingerprints differ (nothing is ever
                               sent across a mismatch). Blocks for at most the constructor's
                               connect_timeout_s (KVTransferError on expiry); never call it on
                               the step loop.
  send(request_id, layer, block_ids, payload)
                               once per (request, layer, chunk), right after that layer's
                               forward pass, as often as layers x chunks. Enqueues and returns;
                               never waits for the peer. The sender keeps a reference to
                               `payload` (a copy only if it is not a contiguous CPU tensor) until
                               the transfer ends, so the caller must hand over a tensor it will
                               not mutate (a gather `kv[layer, :, ids]` is already a fresh one).
  poll(request_id) -> TransferStatus
                               every step while the request is transferring. IN_FLIGHT, DONE
                               (every layer sent so far is acknowledged by the receiver) or
                               FAILED with a reason (a refusal, or no ack within ack_timeout_s of
                               a send: a dead receiver yields FAILED, never a hang). A terminal
                               status is reported once; the id is then forgotten and polling it
                               again raises KeyError. Call it only after the request's last
                               send(), or DONE may mean "done so far". Never blocks.
  close()                      once, at shutdown. Idempotent.

KVReceiver -- decode side only; created with the worker's KVCacheBuffer and layout; it runs its
I/O on a background thread (or, for the fake, inside the sender's call), so the engine thread
only calls these, none of which waits on the network:
  endpoint                     read once and handed to prefill workers via the control plane.
  expect(request_id, block_ids, num_layers, deadline_s)
                               once per request, after the block manager reserved `block_ids`
                               and before the prefill worker is told where to write. The request
                               is complete when every one of layers [0, num_layers) has arrived
                               for every one of `block_ids` (chunked prefill may deliver a layer
                               in several pieces). ValueError on a bad argument or a duplicate id.
  poll() -> list[ReceiveEvent] every step. Each expected request yields exactly one event:
                               COMPLETE once all its KV is in the cache, or FAILED (refused
                               payload, or deadline_s passed). Payloads for an unknown request
                               are refused and yield one FAILED event under that id.
  cancel(request_id)           on abort. Later payloads for it are dropped and no event follows.
  close()                      once, at shutdown. Idempotent.

Invariants every receiver keeps:
- A payload is validated (expected request, blocks it owns, fingerprint, dtype, shape, length,
  checksum) before a byte of it reaches the cache; a refused payload fails its request only.
- After COMPLETE, FAILED or cancel() returns, nothing writes into that request's blocks again,
  so the engine may free them at once. (shm weakens this; see kvtransfer/shm_backend.py.)
- Blocks of a failed request stay owned by that request until the engine frees them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import KVCacheBuffer, KVLayout


class KVTransferError(RuntimeError):
    """A transport could not be set up or used (unreachable peer, closed object)."""


class KVLayoutMismatch(KVTransferError):
    """The peer's KV layout (model identity, geometry or dtype) differs from ours."""


class TransferState(enum.Enum):
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""  # why it failed; empty otherwise

    @property
    def done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def failed(self) -> bool:
        return self.state is TransferState.FAILED


class ReceiveKind(enum.Enum):
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(frozen=True)
class ReceiveEvent:
    request_id: str
    kind: ReceiveKind
    reason: str = ""  # why it failed; empty when complete


class KVSender(ABC):
    """Prefill side. See the module docstring for who calls each method and when."""

    @abstractmethod
    def connect(self, endpoint: str, layout: KVLayout) -> None: ...

    @abstractmethod
    def send(
        self, request_id: str, layer: int, block_ids: Sequence[int], payload: torch.Tensor
    ) -> None: ...

    @abstractmethod
    def poll(self, request_id: str) -> TransferStatus: ...

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
        self, request_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float
    ) -> None: ...

    @abstractmethod
    def poll(self) -> list[ReceiveEvent]: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
