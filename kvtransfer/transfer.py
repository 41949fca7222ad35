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

from collections import deque
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
