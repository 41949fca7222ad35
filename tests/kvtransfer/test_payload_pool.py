"""kvtransfer/payload_pool.py: staging buffers are handed out again only once their send is
done, at most `keep` exist, and a zmq sender held back by them (keep=1, one receiver in this
process) still delivers every layer intact, with the source blocks sent out of order."""

from __future__ import annotations

import pytest
import torch

import kvtransfer as kt
from kvtransfer.payload_pool import PayloadPool
from tests.helpers.kvtransfer_hosts import same_bytes, source_cache, wait_all


class Done:
    """A tracker stand-in: done once the test says so."""

    def __init__(self) -> None:
        self.value = False

    def __call__(self) -> bool:
        return self.value


def test_a_buffer_is_reused_only_after_its_send_is_done():
    pool = PayloadPool(keep=2)
    a, b = pool.take(100), pool.take(100)
    assert a is not None and b is not None and a is not b
    done_a, done_b = Done(), Done()
    pool.sent(a, done_a)
    pool.sent(b, done_b)
    assert not pool.has_free() and pool.take(100) is None  # both in flight: flow control
    done_b.value = True
    assert pool.has_free()
    assert pool.take(60) is b  # the free one, never the one still being sent
    pool.release(b)
    done_a.value = True
    bigger = pool.take(500)  # no free buffer fits: a free one is replaced, still 2 in all
    assert bigger is not None and bigger.numel() == 500 and bigger is not a and bigger is not b
    assert pool.take(10) is not None and pool.take(10) is None


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep"):
        PayloadPool(keep=0)


def test_zmq_sender_held_by_one_buffer_delivers_every_layer():
    # 64 KiB per K block: above pyzmq's copy threshold, so frames really are sent zero-copy and
    # a buffer stays in flight until libzmq has written it.
    layout = kt.KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=64,
                         dtype="float32", model_id="tiny")
    cache = kt.allocate_cache(layout, 8)
    receiver = kt.create_receiver("zmq", cache, layout)
    sender = kt.create_sender("zmq", ack_timeout_s=10.0, connect_timeout_s=10.0)
    try:
        sender._pool = PayloadPool(keep=1)  # every unit waits for the previous one's send
        sender.connect(receiver.endpoint, layout)
        source = source_cache(layout, 6, seed=3)
        src_ids, dst_ids = [5, 0, 1, 3], [2, 3, 4, 7]
        receiver.expect("r", dst_ids, layout.num_layers, 10.0)
        for layer in range(layout.num_layers):
            sender.send("r", layer, 0, source[layer], src_ids)
        sender.finish("r", 9)
        assert wait_all(sender, ["r"])["r"].done
        events = receiver.poll()
        assert kt.ReceiveEvent("r", kt.ReceiveKind.COMPLETE, first_token=9) in events
        want = source[:, :, torch.tensor(src_ids)]
        assert same_bytes(cache.tensor[:, :, torch.tensor(dst_ids)], want)
    finally:
        sender.close()
        receiver.close()
        cache.close()
