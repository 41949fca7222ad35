"""The decode worker's KV connector: receives a remote-prefilled request's KV into the blocks
the scheduler reserved, through the worker's KVReceiver (kvtransfer).

  get_num_new_matched_tokens   remote prefill: every prompt token past the local prefix-cache
                               hits comes from the prefill worker
  update_state_after_alloc     receiver.expect(fresh blocks, skip = cached blocks): the grant
                               the prefill worker's sender asks for
  get_finished                 receiver events: COMPLETE -> received (with the first token),
                               FAILED -> failed, RELEASED -> released
  request_finished             a request that ends while its KV is landing is cancelled on the
                               receiver and keeps its blocks until RELEASED: no writer remains

Transfer ids are the request ids (the coordinator names both the same).
"""

from __future__ import annotations

from common.errors import KV_TRANSFER_FAILED
from engine.kv_connector import ConnectorEvents, KVConnector
from engine.kv_transfer_state import KVTransferState
from engine.request import Request


class DecodeConnector(KVConnector):
    def __init__(self, receiver, num_layers: int, block_size: int, deadline_s: float) -> None:
        self.receiver = receiver  # kvtransfer.KVReceiver
        self.num_layers = num_layers
        self.block_size = block_size
        # From the reservation until all KV has landed; longer than the coordinator's prefill
        # deadline, so a slow but live prefill is never cut off here first.
        self.deadline_s = deadline_s
        self._transfers: dict[str, str] = {}  # open transfer id -> request id
        self._closed: set[str] = set()  # request ids whose transfer the receiver closed (FAILED)
        self._cancelled: set[str] = set()  # request ids ended while RECEIVING, blocks held
        # request id -> KV bytes it will receive (its uncached blocks), for the first event.
        self.expected_bytes: dict[str, int] = {}

    # -- scheduler side --

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> int:
        params = request.kv_transfer
        if params is None or not params.remote_prefill:
            return 0
        return request.num_prompt_tokens - num_local_computed_tokens

    def update_state_after_alloc(self, request: Request, block_ids, num_local_computed_tokens: int) -> None:
        bs = self.block_size
        skip = num_local_computed_tokens // bs
        prompt_blocks = -(-request.num_prompt_tokens // bs)
        fresh = list(block_ids[skip:prompt_blocks])
        tid = request.kv_transfer.transfer_id
        self.receiver.expect(tid, fresh, self.num_layers, self.deadline_s, skip_blocks=skip)
        self._transfers[tid] = request.request_id
        self.expected_bytes[request.request_id] = (
            len(fresh) * self.num_layers * self.receiver.layout.bytes_per_block_per_layer())
        request.kv_state = KVTransferState.RECEIVING

    def request_finished(self, request: Request) -> bool:
        if request.kv_state is not KVTransferState.RECEIVING:
            return False
        self.expected_bytes.pop(request.request_id, None)
        tid = request.kv_transfer.transfer_id
        if request.request_id in self._closed:
            self._closed.discard(request.request_id)  # failed: RELEASED follows by itself
        else:
            self.receiver.cancel(tid)
        self._cancelled.add(request.request_id)
        return True

    # -- worker side --

    def get_finished(self) -> ConnectorEvents:
        events = ConnectorEvents()
        for event in self.receiver.poll():
            request_id = self._transfers.get(event.request_id)
            if request_id is None:
                continue  # a payload for a transfer never expected here: refused, nothing held
            kind = event.kind.value
            if kind == "complete":
                del self._transfers[event.request_id]
                if request_id in self._cancelled:
                    # Completed before our cancel reached the receiver: no writer remains.
                    self._cancelled.discard(request_id)
                    events.released.add(request_id)
                else:
                    events.received[request_id] = event.first_token
            elif kind == "failed":
                if request_id in self._cancelled:
                    continue  # already ended here; its RELEASED follows
                self._closed.add(request_id)
                events.failed[request_id] = f"{KV_TRANSFER_FAILED}: {event.reason}"
            else:  # released
                del self._transfers[event.request_id]
                self._cancelled.discard(request_id)
                events.released.add(request_id)
        return events
