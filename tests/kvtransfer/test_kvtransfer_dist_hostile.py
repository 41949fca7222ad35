"""The dist backend against a hostile network peer (kvtransfer/dist_backend.py, "Trust"): garbage
and oversized frames on its TCPStore port, a forged group join, a pair request without a proof,
a header whose size is not its blocks'. The receiver runs in a host process of its own, so a
gloo abort would show as a dead host, not as a dead test run; after every attack it still
serves a real transfer."""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import replace

import pytest

import kvtransfer as kt
from kvtransfer import dist_group
from kvtransfer.auth import KVAuth
from kvtransfer.message import Ack, KVHeader
from tests.helpers.kvtransfer_hosts import (  # noqa: F401 (pytest fixtures, used by name)
    COMPLETE, FAILED, RELEASED, RawClient, by_transfer, connected_sender, expect, hosts, make_layout,
    no_leaks, open_receiver, same_bytes, send_all, source_cache, wait_all,
)

KEY = KVAuth(b"s" * 32)


class _NoProof(KVAuth):
    """The cluster's keys (CURVE passes) but a forged pair proof."""

    def handshake_proof(self, sender_id: str, now: float | None = None) -> str:
        return f"{int(time.time())}.00.{'0' * 64}"


def _serves(host, key: str, endpoint: str, rid: str, seed: int) -> None:
    layout = make_layout()
    expect(host, key, rid, [6, 7])
    sender = connected_sender("dist", endpoint, layout, auth=KEY)
    source = source_cache(layout, 2, seed=seed)
    send_all(sender, rid, source, [0, 1], first_token=3)
    assert wait_all(sender, [rid])[rid].done
    assert host.call("wait", key, 1, 10.0) == [(rid, COMPLETE, "", 3)]
    assert same_bytes(host.call("cache", key)[:, :, [6, 7]], source)
    sender.close()


def test_store_garbage_oversized_frames_and_a_forged_join_leave_the_receiver_serving(hosts):
    host = hosts("dist")
    layout = make_layout()
    key, endpoint = open_receiver(host, auth=KEY)
    honest = connected_sender("dist", endpoint, layout, auth=KEY)
    port = honest._store.port  # what a port scan finds as well
    assert dist_group.endpoint_host(endpoint) == "127.0.0.1"
    # Raw bytes on the store port: noise, a SET whose key claims 2**62 bytes, a value of 2**40.
    for frame in (b"\xde\xad" * 5000,
                  b"\x01" + struct.pack("<Q", 2**62),
                  b"\x01" + struct.pack("<Q", 3) + b"key" + struct.pack("<Q", 2**40) + b"x" * 4096):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(frame)
            time.sleep(0.1)
    # A forged join: rank 1 of the group an honest pair would have under the old scheme (its
    # sender id). The pair's namespace is a random key the peer never saw: nobody joins it.
    store = dist_group.join_store("127.0.0.1", port, 5.0)
    failed: list[BaseException] = []

    def join() -> None:
        try:
            dist_group.pair_group(store, honest.sender_id, dist_group.SENDER_RANK, "gloo", "127.0.0.1", 1.0)
        except Exception as e:  # the rendezvous times out
            failed.append(e)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    thread.join(30)
    assert failed and not thread.is_alive()
    assert host.proc.is_alive()
    # The honest pair formed before all this still works, and so does a new one.
    expect(host, key, "before", [1])
    send_all(honest, "before", source_cache(layout, 1, seed=40), [0], first_token=2)
    assert wait_all(honest, ["before"])["before"].done
    assert host.call("wait", key, 1, 10.0) == [("before", COMPLETE, "", 2)]
    honest.close()
    _serves(host, key, endpoint, "after", seed=41)
    host.call("close", key)


def test_a_pair_request_without_a_valid_proof_forms_no_group(hosts):
    host = hosts("dist")
    layout = make_layout()
    key, endpoint = open_receiver(host, auth=KEY)
    forger = kt.create_sender("dist", connect_timeout_s=5.0, auth=_NoProof(KEY.key))
    with pytest.raises(kt.KVTransferError, match="refused the process group: pair request without a valid proof"):
        forger.connect(endpoint, layout)
    forger.close()
    assert host.call("stats", key).auth_rejected >= 1
    _serves(host, key, endpoint, "after", seed=42)
    host.call("close", key)


def test_a_header_whose_size_is_not_its_blocks_posts_no_recv(hosts):
    """Within one layer of the cache, but not the bytes of the blocks it names: before this
    check the receiver posted a recv of that size, and a tensor larger than the one posted is
    what makes gloo end the process."""
    host = hosts("dist")
    layout = make_layout()
    key, endpoint = open_receiver(host)
    expect(host, key, "liar", [0])
    raw = RawClient("dist", host, key, endpoint, layout)
    assert raw.ask("liar").ok
    header = KVHeader.for_payload("liar", 0, (0,), source_cache(layout, 1, seed=43)[0], layout, seq=1)
    header = replace(header, payload_nbytes=layout.payload_nbytes(2), sender_id=raw.sender_id)
    raw.sock.send_multipart([b"T", header.encode()])  # and no tensor: none may be waited for
    ack = Ack.decode(raw.recv(b"A"))
    assert not ack.ok and f"not the {layout.payload_nbytes(1)} of its 1 block" in ack.reason
    events = by_transfer(host.call("wait", key, 2, 10.0))
    assert [e[0] for e in events["liar"]] == [FAILED, RELEASED]
    raw.close()
    host.call("close", key)
    key, endpoint = open_receiver(host, auth=KEY)
    _serves(host, key, endpoint, "after", seed=44)
    host.call("close", key)


def test_a_dist_receiver_refuses_a_wildcard_bind():
    layout = make_layout()
    cache = kt.allocate_cache(layout, 4)
    try:
        with pytest.raises(ValueError, match="binds one interface"):
            kt.create_receiver("dist", cache, layout, endpoint="tcp://0.0.0.0:*")
    finally:
        cache.close()
