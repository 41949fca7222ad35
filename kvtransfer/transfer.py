"""The record of one transfer on each side, the one type a transport backend sees.

OutgoingTransfer (sender): created on the engine thread by the first send/finish/abort and
kept in the sender's table until poll() reports it; from then on only the I/O thread touches
its fields, except `result`, which the I/O thread publishes under the sender's lock once it
has dropped every queued unit (so the caller's source blocks are never read again). A backend
reads `transfer_id` (and `asked_at`, to size a grant request's own timeout) and nothing else.

IncomingTransfer (receiver): one expected transfer in a ReceiveTable, created by expect() and
changed only under the table's lock, on whichever thread holds it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .base import TransferStatus
from .message import Grant


@dataclass
class SendUnit:
    """One send(): a layer's blocks first_block, first_block + 1, ... of the request."""

    layer: int
    first_block: int  # block index (position in the request) of src_block_ids[0]
    source: torch.Tensor  # the caller's layer cache [2, num_blocks, block_size, heads, head_dim]
    src_block_ids: tuple[int, ...]


@dataclass
class FinishUnit:
    """The finish(): sent once every granted block of every layer is."""

    first_token: int


@dataclass(eq=False)
class OutgoingTransfer:
    transfer_id: str
    started: float  # first send/finish/abort, time.monotonic()
    result: TransferStatus | None = None  # terminal status; under the sender's lock
    # -- I/O thread only ----------------------------------------------------------------------
    queue: deque[SendUnit | FinishUnit] = field(default_factory=deque)  # waiting for grant/transmit
    asked_at: float | None = None
    grant: Grant | None = None
    sent: list[set[int]] = field(default_factory=list)  # per layer, block indices sent
    units_sent: int = 0
    inflight: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline
    layers: dict[int, int] = field(default_factory=dict)  # seq -> layer, for messages
    finish_seq: int = 0
    finish_acked: bool = False
    # Stage times (time.time_ns; 0 = not reached), published in the terminal TransferStatus
    asked_ns: int = 0
    granted_ns: int = 0
    first_unit_ns: int = 0
    last_ack_ns: int = 0
    finish_ns: int = 0


@dataclass(eq=False)
class IncomingTransfer:
    transfer_id: str
    block_ids: tuple[int, ...]  # destination of block skip_blocks + i
    skip_blocks: int
    num_layers: int
    deadline: float  # time.monotonic()
    started: float
    missing: list[set[int]]  # per layer, destination blocks not yet written
    block_set: frozenset[int] = field(init=False)
    missing_count: int = field(init=False)
    grantee: str = ""  # sender id the grant went to
    finished: bool = False
    first_token: int = 0
    finish_units: int = -1  # data units the sender says it sent; -1 until its finish
    units: int = 0  # data units accepted
    sender_stopped: bool = False  # the grantee will write nothing more (finish/abort/goodbye)

    def __post_init__(self) -> None:
        self.block_set = frozenset(self.block_ids)
        self.missing_count = sum(len(m) for m in self.missing)

    @classmethod
    def expected(
        cls, transfer_id: str, block_ids: Sequence[int], num_layers: int, deadline_s: float,
        skip_blocks: int, num_blocks: int, max_layers: int,
    ) -> IncomingTransfer:
        """The record of an expect() (its deadline from now); ValueError names a bad argument.
        num_blocks and max_layers are the receiver's cache size and layer count."""
        blocks = tuple(int(b) for b in block_ids)
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError(f"transfer_id must be a non-empty str, got {transfer_id!r}")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"{transfer_id}: duplicate block ids in {list(blocks)}")
        bad = [b for b in blocks if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"{transfer_id}: block ids {bad} out of range [0, {num_blocks})")
        if not isinstance(skip_blocks, int) or skip_blocks < 0:
            raise ValueError(f"{transfer_id}: skip_blocks must be an int >= 0, got {skip_blocks!r}")
        if not 1 <= num_layers <= max_layers:
            raise ValueError(f"{transfer_id}: num_layers {num_layers} not in [1, {max_layers}]")
        if not deadline_s > 0:
            raise ValueError(f"{transfer_id}: deadline_s must be > 0, got {deadline_s!r}")
        now = time.monotonic()
        return cls(transfer_id, blocks, skip_blocks, num_layers, now + deadline_s, now,
                   [set(blocks) for _ in range(num_layers)])
