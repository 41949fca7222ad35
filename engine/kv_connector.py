"""The engine's KV connector: how an engine takes part in a KV transfer, as vLLM v1's
KVConnectorBase_V1 does. One connector per engine, chosen by its role (the prefill worker's
sends, the decode worker's receives); an engine without one (the colocated worker, `tandem
run`) never transfers. The engine knows nothing of transports: implementations live with the
nodes (prefill_node/connector.py, decode_node/connector.py) and wrap a kvtransfer backend.

Every method runs on the engine thread. Who calls which, when, how often:

Scheduler side (engine/scheduler.py):
  get_num_new_matched_tokens(request, num_local_computed_tokens) -> int
      once, when the scheduler first allocates for a waiting request that carries
      `kv_transfer`, after the local prefix-cache lookup found num_local_computed_tokens.
      Returns how many of the request's tokens beyond those will arrive from the remote
      (0: compute them here). A positive answer parks the request in WAITING_FOR_REMOTE_KV:
      the scheduler allocates blocks for its whole prompt (+1 slot for the first decoded
      token), then calls
  update_state_after_alloc(request, block_ids, num_local_computed_tokens)
      once, right after that allocation: `block_ids` is the request's whole block table; the
      leading num_local_computed_tokens // block_size of them are shared prefix-cache blocks,
      read-only; the rest are fresh and the remote may write them.
  request_finished(request) -> bool
      once, when the request ends in any state (finished, aborted, failed). True: a transfer
      may still read or write its blocks, so the scheduler must not free them yet; it holds
      them (request.kv_state DRAINING) until get_finished() lists the id in `released`.

Worker side (engine/llm_engine.py, around the forward pass):
  bind_pass(plan) -> save_kv_layer or None
      once per pass, before it runs, with the scheduler's plan. Returns the callback that the
      model calls as save_kv_layer(layer) right after each layer's K/V is in the cache (the
      prefill connector hands that layer's finished blocks to its sender there), or None when
      nothing in the pass is transferred.
  get_finished() -> ConnectorEvents
      once per step, before scheduling: which transfers completed (received, with the first
      token), failed, or let go of their blocks (released: sends acknowledged, or no writer
      left). Each id appears in `received` or `failed` at most once, and in `released` once
      after request_finished() returned True for it.

Invariant: no block of a request is reused while a transfer may still touch it. Blocks are
freed by the scheduler only: at once when request_finished() says False, else when the id is
reported released; never on a timer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.kv_transfer_state import KVTransferParams, KVTransferState

if TYPE_CHECKING:
    from engine.request import Request
    from engine.scheduler_output import SchedulerOutput


@dataclass
class ConnectorEvents:
    received: dict[str, int] = field(default_factory=dict)  # request id -> first token
    failed: dict[str, str] = field(default_factory=dict)  # request id -> reason
    released: set[str] = field(default_factory=set)  # request ids whose blocks may be freed

    def __bool__(self) -> bool:
        return bool(self.received or self.failed or self.released)


class KVConnector(ABC):
    """See the module docstring for the contract."""

    # -- scheduler side --

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_local_computed_tokens: int) -> None:
        return None

    @abstractmethod
    def request_finished(self, request: Request) -> bool: ...

    # -- worker side --

    def bind_pass(self, plan: SchedulerOutput) -> Callable[[int], None] | None:
        return None

    @abstractmethod
    def get_finished(self) -> ConnectorEvents: ...
