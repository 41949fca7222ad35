"""The chaos suite's CI-sized subset and a short overload soak, over real processes
(reliability/chaos.py, reliability/soak.py; the full runs are `python -m reliability.chaos` and
`python -m reliability.soak`), plus the fault proxy's ZMTP splitter on its own."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from reliability import chaos, soak
from reliability.fault_proxy import FaultProxy, ZmtpSplitter, message_kind


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chaos.tiny_model(tmp_path_factory.mktemp("chaos"))


def test_quick_chaos_subset_has_no_wrong_answer_no_leak_and_recovers(model, tmp_path):
    rows = {r.scenario: r for r in chaos.run(model, tmp_path / "logs", quick=True, out=lambda _: None)}
    assert set(rows) == set(chaos.QUICK)
    for r in rows.values():
        detail = f"{r.scenario}: {r}"
        assert r.faults >= 1, detail  # the fault was injected (a one-shot frame fault hit a frame)
        assert r.wrong == 0 and r.hung == 0, detail
        assert r.correct + r.clear_error == r.affected > 0, detail
        assert r.leaked_blocks == 0 and not r.unasked, detail  # every pool asked and full again
        assert r.recover_s is not None, detail  # every worker registered, a probe answered right
    # The kills landed in the phase they aimed at (markers from the KV link and the coordinator).
    assert rows["kill -9 decode @ decoding"].phase_hit, rows["kill -9 decode @ decoding"]
    assert rows["kill -9 prefill @ mid-prefill"].phase_hit, rows["kill -9 prefill @ mid-prefill"]
    # A dead decode worker's stream migrates and ends with the right text.
    assert rows["kill -9 decode @ decoding"].correct == 1, rows["kill -9 decode @ decoding"]
    # A worker whose link to the coordinator is cut but which answers the coordinator's Status
    # probe keeps its stream and its place.
    cut = rows["decode worker's link to the coordinator cut"]
    assert cut.phase_hit and cut.correct == cut.affected == 2, cut
    # A dead prefill worker's request moves to the other one before any token: still right.
    assert rows["kill -9 prefill @ mid-prefill"].correct == 1, rows["kill -9 prefill @ mid-prefill"]
    # A corrupted KV frame is refused (checksum) and the request moves to another placement.
    assert rows["corrupted KV frame"].correct == 1, rows["corrupted KV frame"]
    # The streams a killed coordinator held cannot move; they end, with a clear error, and the
    # workers register with its successor by themselves (recover_s above).
    assert rows["coordinator restart"].clear_error == 3, rows["coordinator restart"]


SECURE_SUBSET = ("kill -9 decode @ decoding", "kill -9 prefill @ mid-prefill")


def test_the_secure_plane_keeps_every_answer_right_through_kills(model, tmp_path):
    """zmq with a cluster secret (CURVE, proofs) and mutual TLS: no link proxy can read the
    encrypted stream, so the phases come from the workers' stats; the kills still land in them,
    the dead workers' requests move and stay right, and the restarted workers rejoin the plane
    with their credentials. (`python -m reliability.chaos --secure --kv-backend B` runs every
    scenario on every backend: README.)"""
    rows = {r.scenario: r for r in chaos.run(model, tmp_path / "logs", only=SECURE_SUBSET,
                                             secure=True, out=lambda _: None)}
    assert set(rows) == set(SECURE_SUBSET)
    for r in rows.values():
        detail = f"{r.scenario}: {r}"
        assert r.wrong == 0 and r.hung == 0 and r.leaked_blocks == 0 and not r.unasked, detail
        assert r.recover_s is not None, detail
    for name in SECURE_SUBSET:
        assert rows[name].phase_hit and rows[name].correct == rows[name].affected == 1, rows[name]


def test_short_overload_soak_sheds_with_retry_after_and_stays_bounded(model, tmp_path):
    report = soak.run(model, tmp_path / "logs", duration_s=15, overload=4, sample_s=1.0,
                      window_s=5.0, capacity_s=5.0, out=lambda _: None)
    assert report.crashed == [], report.crashed
    assert report.wrong == 0
    assert report.outcomes["shed_503"] > 0, report.outcomes  # overload answered 503 ...
    assert report.shed_without_retry_after == 0  # ... always with Retry-After
    assert report.outcomes["normal_done"] > 0 and report.outcomes["disconnected_mid_stream"] > 0, \
        report.outcomes
    # Bounded memory: after warm-up (the capacity run), no process grows by more than a quarter
    # of its size plus 64 MB over the overload (a leak per request would grow with ~1000s).
    for name, s in report.rss_summary(warmup_s=5.0).items():
        assert s["peak"] <= s["first"] * 1.25 + 64, (name, s, report.rss_mb[name])


def zmtp_frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def test_zmtp_splitter_finds_whole_messages_across_any_chunking():
    greeting = bytes(range(64))
    messages = [zmtp_frame(b"READY....", command=True),
                zmtp_frame(b"H", more=True) + zmtp_frame(b"hello"),
                zmtp_frame(b"D", more=True) + zmtp_frame(b"h" * 40, more=True) + zmtp_frame(b"x" * 5000),
                zmtp_frame(b"C", more=True) + zmtp_frame(b"")]
    stream = greeting + b"".join(messages)
    rng = random.Random(0)
    for _ in range(20):
        splitter, units, pos = ZmtpSplitter(), [], 0
        while pos < len(stream):
            n = rng.randint(1, 700)
            units += splitter.feed(stream[pos:pos + n])
            pos += n
        assert b"".join(units[:-len(messages)]) == greeting
        assert units[-len(messages):] == messages
    assert [message_kind(m) for m in messages] == [b"", b"H", b"D", b"C"]


def test_proxy_corrupts_and_replays_exactly_one_message_and_delays_the_rest():
    got = bytearray()
    server = socket.create_server(("127.0.0.1", 0))

    def sink() -> None:
        conn, _ = server.accept()
        try:
            while data := conn.recv(65536):
                got.extend(data)
        except ConnectionResetError:  # the proxy resets its connections when it stops
            pass

    threading.Thread(target=sink, daemon=True).start()
    proxy = FaultProxy("127.0.0.1", server.getsockname()[1], zmtp=True).start()
    try:
        data = zmtp_frame(b"D", more=True) + zmtp_frame(b"p" * 1000)
        other = zmtp_frame(b"A", more=True) + zmtp_frame(b"ack")
        proxy.corrupt(b"D")
        proxy.replay(b"D", 0.0)
        proxy.set(delay_s=0.2)
        client = socket.create_connection(("127.0.0.1", proxy.port))
        start = time.monotonic()
        client.sendall(bytes(64) + other + data + data)
        expected_len = 64 + len(other) + 3 * len(data)  # the corrupted one, its replay, the next
        deadline = time.monotonic() + 10
        while len(got) < expected_len and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.monotonic() - start >= 0.2  # delayed
        assert len(got) == expected_len, len(got)
        body = bytes(got[64 + len(other):])
        copies = [body[i * len(data):(i + 1) * len(data)] for i in range(3)]
        assert copies[0] != data and sum(a != b for a, b in zip(copies[0], data)) == 1  # one byte
        assert copies[1] == data and copies[2] == data  # the next D, untouched, and its replay
        assert proxy.injected["corrupt"] == 1 and proxy.injected["replay"] == 1
        client.close()
    finally:
        proxy.stop()
        server.close()
