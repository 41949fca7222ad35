"""The prefill worker's KV connector: sends each request's KV to its decode worker through
the request's KVSender (kvtransfer), layer by layer, as the pass computes.

Block rule: a non-final chunk sends only the blocks it filled completely; the final chunk sends
the rest, the partial last block included. So every destination block is written exactly once
per layer, the sent blocks are never written again by this engine (a block's filled slots are
final, and later chunks write only later slots of blocks not yet sent), and the receiver's "all
blocks of all layers arrived" means the KV is complete. A prefix-cache hit on this worker
sends its cached blocks with the first chunk (they were never computed here, but the decode
worker may lack them); blocks the decode worker has cached are dropped by the sender (grant).

Ownership: the sender's I/O thread reads a request's source blocks after save_kv_layer
returns, so a request that ends keeps its blocks (request_finished -> True) until the
sender reports the transfer terminal; get_finished then lists it as released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.request_id import log_extra
from engine.kv_connector import ConnectorEvents, KVConnector
from engine.kv_transfer_state import KVTransferState
from engine.request import Request, RequestStatus
from engine.scheduler_output import SchedulerOutput
from worker.trace_spans import kv_send_spans

log = logging.getLogger(__name__)


@dataclass
class _Send:
    sender: object  # kvtransfer.KVSender
    transfer_id: str
    blocks_sent: int = 0  # leading blocks of the request already handed to the sender
    log_id: str = ""  # the client's request id (Request.log_id), for this thread's log lines
    trace: object = None  # traces on: the span the transfer's spans hang under


class PrefillConnector(KVConnector):
    def __init__(self, kv_cache: torch.Tensor, block_size: int,
                 block_table: Callable[[str], list[int]],
                 on_transfer_end: Callable[[str, object], None] | None = None) -> None:
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.block_table = block_table  # the engine's block manager lookup (engine thread)
        # Told of each transfer's terminal status (request id, kvtransfer.TransferStatus): the
        # worker's metrics and the sender pool's health.
        self.on_transfer_end = on_transfer_end
        self._open: dict[str, _Send] = {}  # computing
        self._draining: dict[str, _Send] = {}  # ended: finish or abort sent, blocks held

    # -- scheduler side --

    def request_finished(self, request: Request) -> bool:
        send = self._open.pop(request.request_id, None)
        if send is None:
            send = self._start(request)
        if send is None:
            return False
        if request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) \
                and request.output_token_ids:
            send.sender.finish(send.transfer_id, request.output_token_ids[0])
        else:
            # Aborted or failed: the decode worker learns it at once, and the sender stops
            # reading our blocks.
            send.sender.abort(send.transfer_id, f"prefill ended: {request.status.value}")
        self._draining[request.request_id] = send
        return True

    # -- worker side --

    def bind_pass(self, plan: SchedulerOutput) -> Callable[[int], None] | None:
        """Which blocks each transferring chunk of this pass sends, fixed before the pass runs."""
        bs = self.block_size
        sends = []
        for chunk in plan.chunks:
            send = self._open.get(chunk.request_id) or self._start(chunk.request)
            if send is None:
                continue
            end = chunk.start_pos + chunk.num_tokens
            upto = -(-end // bs) if chunk.samples else end // bs
            if upto <= send.blocks_sent:
                continue
            src = self.block_table(chunk.request_id)[send.blocks_sent:upto]
            sends.append((send, send.blocks_sent, src))
            send.blocks_sent = upto
        if not sends:
            return None
        kv = self.kv_cache

        def save_kv_layer(layer: int) -> None:
            for send, first, src in sends:
                send.sender.send(send.transfer_id, layer, first, kv[layer], src)
        return save_kv_layer

    def get_finished(self) -> ConnectorEvents:
        events = ConnectorEvents()
        for request_id, send in list(self._draining.items()):
            try:
                status = send.sender.poll(send.transfer_id)
            except KeyError:  # never reached the sender's books: nothing reads our blocks
                status = None
            if status is not None and status.state.value == "in_flight":
                continue
            del self._draining[request_id]
            events.released.add(request_id)
            if status is None:
                continue
            if self.on_transfer_end is not None:
                self.on_transfer_end(request_id, status)
            if send.trace is not None:
                kv_send_spans(send.trace, send.transfer_id, status)
            if status.failed:
                log.warning("KV transfer %s failed: %s", send.transfer_id, status.reason,
                            extra=log_extra(send.log_id))
        return events

    # -- internals --

    def _start(self, request: Request) -> _Send | None:
        params = request.kv_transfer
        if params is None or params.peer is None:
            return None
        send = _Send(params.peer, params.transfer_id, log_id=request.log_id, trace=params.trace)
        self._open[request.request_id] = send
        request.kv_state = KVTransferState.SENDING
        return send
