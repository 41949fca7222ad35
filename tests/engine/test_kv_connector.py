"""The KV connector contract, step by step, as vLLM's remote-prefill lifecycle tests drive it:
the scheduler and block manager with the real DecodeConnector and PrefillConnector over
scripted transports (no model, no sockets). Every path ends with the pool checked."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from decode_node.connector import DecodeConnector
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.kv_transfer_state import KVTransferParams, KVTransferState
from engine.request import Request, RequestStatus
from common.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kvtransfer.base import ReceiveEvent, ReceiveKind, TransferState, TransferStatus
from prefill_node.connector import PrefillConnector

BS = 4
LAYERS = 3


@dataclass
class _Layout:
    def bytes_per_block_per_layer(self) -> int:
        return 100


@dataclass
class ScriptedReceiver:
    """Records what the connector asks; the test decides what the transport reports."""

    layout: _Layout = field(default_factory=_Layout)
    expected: dict = field(default_factory=dict)  # transfer id -> (block ids, skip)
    cancelled: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def expect(self, tid, block_ids, num_layers, deadline_s, skip_blocks=0):
        assert num_layers == LAYERS and tid not in self.expected
        self.expected[tid] = (list(block_ids), skip_blocks)

    def cancel(self, tid):
        self.cancelled.append(tid)

    def poll(self):
        events, self.events = self.events, []
        return events


@dataclass
class ScriptedSender:
    sends: list = field(default_factory=list)  # (tid, layer, first_block, src ids)
    finished: dict = field(default_factory=dict)
    aborted: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)  # tid -> TransferStatus to report

    def send(self, tid, layer, first_block, source, src_block_ids):
        self.sends.append((tid, layer, first_block, list(src_block_ids)))

    def finish(self, tid, first_token):
        self.finished[tid] = first_token

    def abort(self, tid, reason):
        self.aborted[tid] = reason

    def poll(self, tid):
        return self.status.get(tid, TransferStatus(TransferState.IN_FLIGHT))


def decode_side(num_blocks=16, budget=64):
    bm = BlockManager(num_blocks, BS)
    receiver = ScriptedReceiver()
    connector = DecodeConnector(receiver, LAYERS, BS, deadline_s=30.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), bm, connector)
    return sched, bm, receiver, connector


def remote(rid, prompt, max_tokens=8) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0.0), max_tokens,
                   kv_transfer=KVTransferParams(rid, remote_prefill=True))


def apply(sched, connector):
    return sched.update_from_connector(connector.get_finished())


def test_remote_request_reserves_grants_and_parks():
    sched, bm, receiver, _ = decode_side()
    req = remote("r", range(10))  # 3 blocks of prompt; the table holds 11 slots: 3 blocks
    sched.add_request(req)
    plan = sched.schedule()
    assert plan.is_empty  # nothing to compute here
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert req.kv_state is KVTransferState.RECEIVING
    assert sched.waiting_for_kv == {"r": req} and not sched.waiting
    blocks, skip = receiver.expected["r"]
    assert skip == 0 and blocks == bm.block_table("r")[:3]
    assert sched.has_transfers() and not sched.has_schedulable()


def test_completion_admits_with_the_first_token_then_decodes():
    sched, bm, receiver, connector = decode_side()
    req = remote("r", range(10))
    sched.add_request(req)
    sched.schedule()
    assert apply(sched, connector) == []  # partial arrival: nothing reported, nothing changes
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    receiver.events.append(ReceiveEvent("r", ReceiveKind.COMPLETE, first_token=77))
    assert apply(sched, connector) == []
    assert req.status is RequestStatus.RUNNING and req.kv_state is KVTransferState.RECEIVED
    assert req.output_token_ids == [77] and req.num_computed_tokens == 10
    (chunk,) = sched.schedule().chunks
    assert (chunk.start_pos, chunk.num_tokens, chunk.samples) == (10, 1, True)
    sched.finish_request("r", RequestStatus.FINISHED_LENGTH)
    assert bm.num_free_blocks == bm.num_blocks and not sched.draining


def test_first_token_that_ends_the_request_finishes_at_admission():
    sched, bm, receiver, connector = decode_side()
    req = remote("r", range(6), max_tokens=1)
    sched.add_request(req)
    sched.schedule()
    receiver.events.append(ReceiveEvent("r", ReceiveKind.COMPLETE, first_token=5))
    (ended,) = apply(sched, connector)
    assert ended == (req, "") and req.status is RequestStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("when", ["queued", "receiving", "running"])
def test_abort_in_each_state_frees_only_when_no_writer_remains(when):
    sched, bm, receiver, connector = decode_side(num_blocks=2)  # the second request must queue
    sched.add_request(remote("big", range(7)))  # 2 blocks: the whole pool
    req = remote("r", range(5))
    sched.add_request(req)
    sched.schedule()
    if when != "queued":
        sched.finish_request("big", RequestStatus.FINISHED_ABORTED)
        assert sched.draining.keys() == {"big"}  # receiving: held until released
        receiver.events.append(ReceiveEvent("big", ReceiveKind.RELEASED))
        apply(sched, connector)
        sched.schedule()
        assert req.kv_state is KVTransferState.RECEIVING
    if when == "running":
        receiver.events.append(ReceiveEvent("r", ReceiveKind.COMPLETE, first_token=1))
        apply(sched, connector)
        assert req.status is RequestStatus.RUNNING
    used = bm.num_used_blocks
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)
    if when == "receiving":
        assert receiver.cancelled[-1] == "r"
        assert bm.num_used_blocks == used and sched.draining.keys() == {"r"}
        assert req.kv_state is KVTransferState.DRAINING
        receiver.events.append(ReceiveEvent("r", ReceiveKind.RELEASED))
        apply(sched, connector)
    else:
        assert "r" not in receiver.cancelled and "r" not in sched.draining
    if when == "queued":
        sched.finish_request("big", RequestStatus.FINISHED_ABORTED)
        receiver.events.append(ReceiveEvent("big", ReceiveKind.RELEASED))
        apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks and not sched.draining and not sched.requests
    bm.check_invariants()


def test_failed_transfer_ends_the_request_and_holds_blocks_until_released():
    sched, bm, receiver, connector = decode_side()
    req = remote("r", range(9))
    sched.add_request(req)
    sched.schedule()
    receiver.events.append(ReceiveEvent("r", ReceiveKind.FAILED, reason="checksum mismatch"))
    (ended,) = apply(sched, connector)
    assert ended[0] is req and "checksum mismatch" in ended[1]
    assert req.status is RequestStatus.FINISHED_ERROR and req.kv_state is KVTransferState.DRAINING
    assert receiver.cancelled == []  # the receiver closed it itself
    assert bm.num_used_blocks > 0
    receiver.events.append(ReceiveEvent("r", ReceiveKind.RELEASED))
    apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks and req.kv_state is KVTransferState.RELEASED


def test_completion_racing_a_cancel_releases_the_blocks():
    sched, bm, receiver, connector = decode_side()
    sched.add_request(remote("r", range(9)))
    sched.schedule()
    receiver.events.append(ReceiveEvent("r", ReceiveKind.COMPLETE, first_token=3))  # in flight
    sched.finish_request("r", RequestStatus.FINISHED_ABORTED)  # the abort lands first
    apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks and not sched.draining


def test_cached_prefix_is_reserved_shared_and_only_new_blocks_are_granted():
    sched, bm, receiver, connector = decode_side()
    prefix = list(range(100, 108))  # two full blocks
    first = remote("a", prefix + [1, 2, 3])
    sched.add_request(first)
    sched.schedule()
    receiver.events.append(ReceiveEvent("a", ReceiveKind.COMPLETE, first_token=9))
    apply(sched, connector)  # committed: its two full prompt blocks are in the prefix cache
    second = remote("b", prefix + [4, 5, 6, 7, 8])
    sched.add_request(second)
    sched.schedule()
    blocks, skip = receiver.expected["b"]
    assert skip == 2 and blocks == bm.block_table("b")[2:4]
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]  # shared, read-only
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 8
    assert connector.expected_bytes["b"] == 2 * LAYERS * 100  # only the two new blocks move
    for rid in ("a", "b"):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    receiver.events.append(ReceiveEvent("b", ReceiveKind.RELEASED))
    apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_remote_reservations_wait_in_arrival_order_when_the_pool_is_full():
    sched, bm, receiver, connector = decode_side(num_blocks=4)
    for rid in ("a", "b", "c"):
        sched.add_request(remote(rid, range(7)))  # 2 blocks each
    sched.schedule()
    assert set(receiver.expected) == {"a", "b"} and [r.request_id for r in sched.waiting] == ["c"]
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.schedule()
    assert "c" not in receiver.expected  # a's blocks are still held: no writer-free yet
    receiver.events.append(ReceiveEvent("a", ReceiveKind.RELEASED))
    apply(sched, connector)
    sched.schedule()
    assert "c" in receiver.expected


# -- prefill side ---------------------------------------------------------------------------

def prefill_side(budget=6, num_blocks=16):
    bm = BlockManager(num_blocks, BS)
    connector = PrefillConnector(kv_cache=[f"layer{i}" for i in range(LAYERS)], block_size=BS,
                                 block_table=bm.block_table)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), bm, connector)
    return sched, bm, connector


def prefill_request(rid, prompt, sender) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0.0), 1,
                   kv_transfer=KVTransferParams(rid, peer=sender))


def run_pass(sched, connector, sampled=None):
    plan = sched.schedule()
    save = connector.bind_pass(plan)
    if save is not None:
        for layer in range(LAYERS):
            save(layer)
    return plan, sched.update_from_output(plan, sampled or {})


def test_prefill_sends_each_block_once_per_layer_across_chunks_and_finishes():
    sched, bm, connector = prefill_side(budget=6)
    sender = ScriptedSender()
    req = prefill_request("p", range(14), sender)  # 4 blocks; chunks of 6: 0-6, 6-12, 12-14
    sched.add_request(req)
    run_pass(sched, connector)
    run_pass(sched, connector)
    plan, finished = run_pass(sched, connector, {"p": 42})
    table = bm.block_table("p")
    per_layer = {}
    for tid, layer, first, src in sender.sends:
        per_layer.setdefault(layer, []).append((first, src))
    # chunk 1 fills block 0 only; chunk 2 fills blocks 1-2; the last sends the partial block 3
    assert per_layer[0] == [(0, table[:1]), (1, table[1:3]), (3, table[3:4])]
    assert all(per_layer[layer] == per_layer[0] for layer in range(LAYERS))
    assert finished == [req] and sender.finished == {"p": 42}
    assert req.kv_state is KVTransferState.DRAINING and bm.num_used_blocks == 4  # held
    apply(sched, connector)
    assert bm.num_used_blocks == 4  # still in flight
    sender.status["p"] = TransferStatus(TransferState.DONE)
    apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks and req.kv_state is KVTransferState.RELEASED


@pytest.mark.parametrize("when", ["queued", "mid_prefill"])
def test_prefill_abort_tells_the_receiver_and_holds_blocks_until_the_sender_settles(when):
    sched, bm, connector = prefill_side(budget=4)
    sender = ScriptedSender()
    sched.add_request(prefill_request("p", range(12), sender))
    if when == "mid_prefill":
        run_pass(sched, connector)
    sched.finish_request("p", RequestStatus.FINISHED_ABORTED)
    assert "p" in sender.aborted and sender.finished == {}
    sender.status["p"] = TransferStatus(TransferState.FAILED, "aborted")
    apply(sched, connector)
    assert bm.num_free_blocks == bm.num_blocks and not sched.draining


def test_prefill_cached_prefix_blocks_are_sent_with_the_first_chunk():
    sched, bm, connector = prefill_side(budget=64)
    warm = ScriptedSender()
    sched.add_request(prefill_request("a", range(9), warm))
    run_pass(sched, connector, {"a": 1})
    warm.status["a"] = TransferStatus(TransferState.DONE)
    apply(sched, connector)  # a's two full blocks stay cached after it is freed
    sender = ScriptedSender()
    req = prefill_request("b", list(range(8)) + [50, 51], sender)
    sched.add_request(req)
    plan, _ = run_pass(sched, connector, {"b": 2})
    assert req.num_cached_tokens == 8 and plan.chunks[0].start_pos == 8
    assert [s[2:] for s in sender.sends if s[1] == 0] == [(0, bm.block_table("b"))]
