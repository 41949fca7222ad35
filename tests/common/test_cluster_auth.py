"""The authenticated internal plane (common/cluster_auth.py, kvtransfer/auth.py): the
Registry refuses workers without the cluster secret, workers refuse callers that are not the
coordinator, mutual TLS refuses peers without a certificate of the cluster's CA, and the KV
receivers drop and count frames from peers without the secret, leaving the cache untouched."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtransfer as kt
from coordinator.config import CoordinatorConfig
from coordinator.registry import WorkerRegistry, start_registry_server
from common.cluster_auth import (
    PROOF_HEADER, PROOF_WINDOW_S, REGISTER_METHOD, ClusterAuth, TLSFiles, proof_client_interceptors,
    request_bytes,
)
from worker.node_server import NodeFailure, NodeIdentity, register_and_heartbeat
from common.rpc import worker_pb2 as pb
from common.rpc import worker_pb2_grpc as pb_grpc
from worker.runtime import worker_env
from kvtransfer.auth import KVAuth, kv_auth_from
from kvtransfer.message import GrantRequest, HandshakeRequest, KVHeader, tensor_bytes
from kvtransfer.pb import kvtransfer_pb2 as kvpb
from kvtransfer.pb import kvtransfer_pb2_grpc as kvpb_grpc
from deploy.process_plan import free_port
from tests.helpers.cluster import running_cluster
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.tls_certs import issue, make_ca

SECRET = b"correct horse battery staple 42"
OTHER = b"another cluster's secret, 1234567"
LAYOUT = kt.KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32",
                     model_id="tiny")


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


# ---- configuration ------------------------------------------------------------------------------


def test_start_up_checks_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="too short"):
        ClusterAuth(b"short")
    with pytest.raises(ValueError, match="does not exist"):
        ClusterAuth.from_sources(str(tmp_path / "nope"), env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        ClusterAuth.from_sources(str(tmp_path / "empty"), env={})
    with pytest.raises(ValueError, match="--tls-key, --tls-ca missing"):
        ClusterAuth.from_sources(env={}, tls_cert=str(tmp_path / "c.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        TLSFiles(tmp_path / "junk.pem", tmp_path / "junk.pem", tmp_path / "junk.pem")
    (tmp_path / "secret").write_text(SECRET.decode() + "\n")
    from_file = ClusterAuth.from_sources(str(tmp_path / "secret"), env={})
    from_env = ClusterAuth.from_sources(env={"TANDEM_CLUSTER_SECRET": SECRET.decode()})
    assert from_file.secret == from_env.secret == SECRET
    assert SECRET.decode() not in repr(from_file) and SECRET.decode() not in from_file.describe()
    assert ClusterAuth.from_sources(env={}) == ClusterAuth()  # the default: open, plaintext


def test_a_proof_opens_one_method_for_a_while_and_needs_the_secret():
    auth, other = ClusterAuth(SECRET), ClusterAuth(OTHER)
    now = 1_000_000.0
    proof = auth.proof("/tandem.worker.Registry/Register", now)
    assert auth.check("/tandem.worker.Registry/Register", proof, now + 10) == ""
    assert "wrong cluster proof" in other.check("/tandem.worker.Registry/Register", proof, now)
    assert "wrong cluster proof" in auth.check("/tandem.worker.Registry/Heartbeat", proof, now)
    assert "stale" in auth.check("/tandem.worker.Registry/Register", proof, now + 3600)
    assert "no cluster proof" in auth.check("/x/Y", None, now)
    assert "malformed" in auth.check("/x/Y", "garbage", now)


# ---- registration -------------------------------------------------------------------------------


def _info(worker_id: str) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1",
                         model_fingerprint="fp", kv_backend="zmq", kv_layout_fingerprint="l")


async def _with_registry(auth: ClusterAuth, body):
    registry = WorkerRegistry(CoordinatorConfig(cluster_auth=auth), "fp")
    server, port = await start_registry_server(registry, "127.0.0.1", 0)
    try:
        return await body(registry, f"127.0.0.1:{port}")
    finally:
        await server.stop(0)
        await registry.close()


def test_a_proof_opens_one_request_once():
    auth = ClusterAuth(SECRET)
    now = 1_000_000.0
    body = request_bytes(_info("w"))
    proof = auth.proof(REGISTER_METHOD, now, body=body)
    assert auth.check(REGISTER_METHOD, proof, now, body=body) == ""
    assert "another request" in auth.check(REGISTER_METHOD, proof, now,
                                           body=request_bytes(_info("rogue")))
    assert auth.admit(REGISTER_METHOD, proof, now + 1, body=body) == ""
    assert "replayed" in auth.admit(REGISTER_METHOD, proof, now + 2, body=body)
    assert "malformed" in auth.check(REGISTER_METHOD, proof.rsplit(".", 1)[0], now)  # older format


def test_remembered_nonces_expire_with_their_proofs():
    auth = ClusterAuth(SECRET)
    now = 1_000_000.0
    for i in range(100):
        assert auth.admit("/m", auth.proof("/m", now + i), now + i) == ""
    assert len(auth.nonces) == 100
    later = now + 99 + PROOF_WINDOW_S + 1  # every proof above is stale by now
    assert auth.admit("/m", auth.proof("/m", later), later) == ""
    assert len(auth.nonces) == 1


class _Capture(grpc.aio.UnaryUnaryClientInterceptor):
    """Sits behind the proof interceptor and records the proofs it sent (a sniffer's view)."""

    def __init__(self) -> None:
        self.proofs: list[str] = []

    async def intercept_unary_unary(self, continuation, details, request):
        self.proofs.append(dict(details.metadata)[PROOF_HEADER])
        return await continuation(details, request)


def test_a_replayed_register_proof_is_refused_and_counted_whatever_the_body():
    auth = ClusterAuth(SECRET)
    sniffer = _Capture()

    async def body(registry, address):
        async with grpc.aio.insecure_channel(
                address, interceptors=[*proof_client_interceptors(auth), sniffer]) as channel:
            assert (await pb_grpc.RegistryStub(channel).Register(_info("w"), timeout=5)).accepted
        outcomes = {}
        async with grpc.aio.insecure_channel(address) as channel:  # the replayer's, no secret
            stub = pb_grpc.RegistryStub(channel)
            for name, info in (("same body", _info("w")), ("other body", _info("rogue"))):
                try:
                    await stub.Register(info, timeout=5,
                                        metadata=((PROOF_HEADER, sniffer.proofs[0]),))
                    outcomes[name] = "accepted"
                except grpc.aio.AioRpcError as exc:
                    outcomes[name] = (exc.code(), exc.details())
        return outcomes, {r.worker_id for r in registry.all()}

    outcomes, known = asyncio.run(_with_registry(auth, body))
    assert outcomes["same body"][0] is grpc.StatusCode.UNAUTHENTICATED
    assert "replayed" in outcomes["same body"][1]
    assert outcomes["other body"][0] is grpc.StatusCode.UNAUTHENTICATED
    assert "another request" in outcomes["other body"][1]
    assert known == {"w"}
    assert auth.refused.snapshot() == {(REGISTER_METHOD, "replayed"): 1,
                                       (REGISTER_METHOD, "other_request"): 1}


def test_the_registry_refuses_a_worker_without_the_secret_and_the_worker_gives_up():
    identity = NodeIdentity("rogue", "decode", "127.0.0.1:1", "", "zmq", "fp", "l")

    async def body(registry, address):
        outcomes = {}
        for name, auth in (("none", ClusterAuth()), ("wrong", ClusterAuth(OTHER)),
                           ("right", ClusterAuth(SECRET))):
            async with auth.aio_channel(address) as channel:
                try:
                    reply = await pb_grpc.RegistryStub(channel).Register(_info(name), timeout=5)
                    outcomes[name] = ("accepted", reply.accepted)
                except grpc.aio.AioRpcError as exc:
                    outcomes[name] = (exc.code(), exc.details())
        # The worker's own loop: a refusal ends it with NodeFailure (the process exits 1).
        with pytest.raises(NodeFailure, match="registration refused: wrong cluster proof"):
            await asyncio.wait_for(register_and_heartbeat(
                address, identity, pb.WorkerStatus, asyncio.Event(), ClusterAuth(OTHER)), 10)
        return outcomes, {r.worker_id for r in registry.all()}

    outcomes, known = asyncio.run(_with_registry(ClusterAuth(SECRET), body))
    assert outcomes["none"][0] is grpc.StatusCode.UNAUTHENTICATED
    assert "no cluster proof: the caller has no cluster secret" == outcomes["none"][1]
    assert outcomes["wrong"] == (grpc.StatusCode.UNAUTHENTICATED,
                                 "wrong cluster proof: the caller's cluster secret is a different one")
    assert outcomes["right"] == ("accepted", True)
    assert known == {"right"}


def test_refused_calls_are_counted_and_exported_with_the_workers_reports():
    from coordinator.metrics import Metrics

    auth = ClusterAuth(SECRET)
    worker_report = pb.WorkerStatus(refused_calls=[pb.RefusedCalls(
        method="/tandem.worker.DecodeWorker/Generate", reason="stale", count=3)])

    async def body(registry, address):
        for caller in (ClusterAuth(), ClusterAuth(OTHER), ClusterAuth(OTHER)):
            async with caller.aio_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await pb_grpc.RegistryStub(channel).Register(_info("rogue"), timeout=5)
        async with auth.aio_channel(address) as channel:
            stub = pb_grpc.RegistryStub(channel)
            assert (await stub.Register(_info("w"), timeout=5)).accepted
            assert (await stub.Heartbeat(pb.HeartbeatRequest(worker_id="w", status=worker_report),
                                         timeout=5)).known
        return Metrics("tiny").render(registry.all(), 0, 0, auth.refused.snapshot()).decode()

    text = asyncio.run(_with_registry(auth, body))
    register = "/tandem.worker.Registry/Register"
    assert auth.refused.snapshot() == {(register, "no_proof"): 1, (register, "wrong_secret"): 2}
    assert (f'tandem_grpc_refused_calls_total{{method="{register}",process="coordinator",'
            'reason="wrong_secret"} 2.0') in text
    assert ('tandem_grpc_refused_calls_total{method="/tandem.worker.DecodeWorker/Generate",'
            'process="w",reason="stale"} 3.0') in text


def test_a_worker_with_the_secret_refuses_a_coordinator_without_it():
    identity = NodeIdentity("w", "decode", "127.0.0.1:1", "", "zmq", "fp", "l")

    async def body(registry, address):
        with pytest.raises(NodeFailure, match="did not prove the cluster secret: no cluster proof"):
            await asyncio.wait_for(register_and_heartbeat(
                address, identity, pb.WorkerStatus, asyncio.Event(), ClusterAuth(SECRET)), 10)

    asyncio.run(_with_registry(ClusterAuth(), body))
    # ... and serves one that has it (the loop runs on: stopped from outside).

    async def accepted(registry, address):
        stop = asyncio.Event()
        task = asyncio.create_task(register_and_heartbeat(
            address, identity, pb.WorkerStatus, stop, ClusterAuth(SECRET)))
        while registry.get("w") is None and not task.done():
            await asyncio.sleep(0.01)
        stop.set()
        await task
        return registry.get("w") is not None

    assert asyncio.run(_with_registry(ClusterAuth(SECRET), accepted))


def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_cluster(tmp_path):
    ca = make_ca(tmp_path / "ca")
    node = issue(tmp_path, ca, "node")
    stranger = issue(tmp_path, make_ca(tmp_path / "other", "other-ca"), "stranger")
    auth = ClusterAuth(SECRET, TLSFiles(node.cert, node.key, node.ca))

    async def body(registry, address):
        results = {}
        plain = grpc.aio.insecure_channel(address)
        no_cert = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca[0].read_bytes()))
        foreign = ClusterAuth(SECRET, TLSFiles(stranger.cert, stranger.key, node.ca)).aio_channel(address)
        for name, channel in (("plain", plain), ("no cert", no_cert), ("foreign cert", foreign),
                              ("cluster cert", auth.aio_channel(address))):
            async with channel:
                try:
                    reply = await pb_grpc.RegistryStub(channel).Register(_info("w"), timeout=5)
                    results[name] = reply.accepted
                except grpc.aio.AioRpcError as exc:
                    results[name] = exc.code()
        return results

    results = asyncio.run(_with_registry(auth, body))
    assert results == {"plain": grpc.StatusCode.UNAVAILABLE, "no cert": grpc.StatusCode.UNAVAILABLE,
                       "foreign cert": grpc.StatusCode.UNAVAILABLE, "cluster cert": True}


# ---- the KV plane -------------------------------------------------------------------------------


def _wait(receiver, count: int = 1, timeout_s: float = 10.0) -> list:
    events, deadline = [], time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += receiver.poll()
        time.sleep(0.01)
    return events



def _honest_grpc_transfer(receiver, cache, auth) -> None:
    """A sender with the cluster's credentials completes transfer "t1" (blocks 0 and 1)."""
    sender = kt.create_sender("grpc", auth=auth)
    sender.connect(receiver.endpoint, LAYOUT)
    source = torch.randn(LAYOUT.num_layers, 2, 8, 4, 2, 4)
    assert _send(sender, "t1", source).done
    assert [e.kind for e in _wait(receiver)] == [kt.ReceiveKind.COMPLETE]
    assert torch.equal(cache.tensor[:, :, :2], source[:, :, :2])
    sender.close()

def _send(sender, transfer_id: str, source: torch.Tensor) -> kt.TransferStatus:
    for layer in range(LAYOUT.num_layers):
        sender.send(transfer_id, layer, 0, source[layer], [0, 1])
    sender.finish(transfer_id, 7)
    # A guard against a hang, not a speed check: the transfer takes milliseconds, and a loaded
    # host gets a minute before the test calls it stuck.
    deadline = time.monotonic() + 60
    while (status := sender.poll(transfer_id)).state is kt.TransferState.IN_FLIGHT:
        assert time.monotonic() < deadline, f"transfer {transfer_id} still in flight after 60 s"
        time.sleep(0.01)
    return status


def _rogue_frames(transfer_id: str, token: bytes = b"") -> list[list[bytes]]:
    """What a rogue that knows the layout would send a zmq receiver: hello, ask, a data unit
    for block 0 of layer 0 with a right fingerprint and checksum, and a finish."""
    payload = torch.full(LAYOUT.payload_shape(1), 9.0)
    header = KVHeader.for_payload(transfer_id, 0, (0,), payload, LAYOUT, 1, sender_id="rogue",
                                  auth_token=token)
    return [[b"H", HandshakeRequest(LAYOUT, "rogue").encode()], [b"G", GrantRequest(transfer_id, "rogue", token).encode()],
            [b"D", header.encode(), bytes(tensor_bytes(payload))],
            [b"C", KVHeader(transfer_id, seq=2, sender_id="rogue", finish=True, num_units=1,
                            auth_token=token).encode()]]


def _send_unanswered(sock: zmq.Socket, messages: list[list[bytes]]) -> None:
    """Send what the socket takes: once the receiver has refused its handshake a DEALER has no
    peer left, and a blocking send would wait forever (seen on a loaded machine)."""
    for frames in messages:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return


@pytest.mark.parametrize("backend", ["zmq", "shm"])
def test_a_rogue_zmq_peer_cannot_feed_kv_and_is_counted(backend, tmp_path):
    auth = KVAuth(b"k" * 32)
    name = f"tdm-auth-{backend}-{time.monotonic_ns()}" if backend == "shm" else None
    cache = kt.allocate_cache(LAYOUT, 8, shared_memory_name=name)
    receiver = kt.create_receiver(backend, cache, LAYOUT, auth=auth)
    ctx = zmq.Context()
    try:
        receiver.expect("t1", [0, 1], LAYOUT.num_layers, 30.0)
        # No CURVE keys at all, then CURVE with a key pair of its own and a guessed server key.
        plain = ctx.socket(zmq.DEALER)
        curved = ctx.socket(zmq.DEALER)
        curved.curve_serverkey = KVAuth(b"g" * 32).curve_server()[0]
        curved.curve_publickey, curved.curve_secretkey = zmq.curve_keypair()
        stolen = ctx.socket(zmq.DEALER)  # the server's key leaked, but not the client's
        stolen.curve_serverkey = auth.curve_server()[0]
        stolen.curve_publickey, stolen.curve_secretkey = zmq.curve_keypair()
        for sock in (plain, curved, stolen):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(receiver.endpoint)
            _send_unanswered(sock, _rogue_frames("t1"))
        deadline = time.monotonic() + 10
        while receiver.stats().auth_rejected < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert receiver.stats().auth_rejected >= 3  # every failed handshake counts
        assert all(not sock.poll(200) for sock in (plain, curved, stolen))  # nothing answered
        assert not cache.tensor.any() and receiver.poll() == []
        # A sender of another cluster cannot connect; the cluster's own completes the transfer.
        stranger = kt.create_sender(backend, connect_timeout_s=1.0, auth=KVAuth(b"x" * 32))
        with pytest.raises(kt.KVTransferError, match="cluster secret"):
            stranger.connect(receiver.endpoint, LAYOUT)
        stranger.close()
        sender = kt.create_sender(backend, auth=auth)
        sender.connect(receiver.endpoint, LAYOUT)
        source = torch.randn(LAYOUT.num_layers, 2, 8, 4, 2, 4)
        assert _send(sender, "t1", source).done
        assert [e.kind for e in _wait(receiver)] == [kt.ReceiveKind.COMPLETE]
        assert torch.equal(cache.tensor[:, :, :2], source[:, :, :2])
        assert receiver.stats().transfers_done == 1
        sender.close()
        for sock in (plain, curved, stolen):
            sock.close()
    finally:
        receiver.close()
        cache.close()
        ctx.term()


def test_a_grpc_unit_with_a_bad_token_is_dropped_and_counted():
    auth = KVAuth(b"k" * 32)
    cache = kt.allocate_cache(LAYOUT, 8)
    receiver = kt.create_receiver("grpc", cache, LAYOUT, auth=auth)
    try:
        receiver.expect("t1", [0, 1], LAYOUT.num_layers, 30.0)
        channel = grpc.insecure_channel(receiver.endpoint)
        stub = kvpb_grpc.KVTransferStub(channel)
        payload = torch.full(LAYOUT.payload_shape(1), 9.0)
        acks = []
        for token in (b"", b"forged-token-0123456789abcdef0123", KVAuth(b"z" * 32).token("t1")):
            header = KVHeader.for_payload("t1", 0, (0,), payload, LAYOUT, 1, sender_id="rogue",
                                          auth_token=token)
            acks.append(stub.Push(iter([kvpb.PushChunk(header=header.to_pb(),
                                                       data=bytes(tensor_bytes(payload)))]),
                                  timeout=5))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Grant(GrantRequest("t1", "rogue", b"").to_pb(), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        assert [a.ok for a in acks] == [False, False, False]
        assert all("unauthenticated" in a.reason for a in acks)
        assert receiver.stats().auth_rejected == 4 and receiver.stats().units == 0
        assert not cache.tensor.any() and receiver.poll() == []  # the transfer lives on
        _honest_grpc_transfer(receiver, cache, auth)
    finally:
        receiver.close()
        cache.close()


def test_a_grpc_handshake_without_a_proof_learns_nothing_and_is_counted():
    auth = KVAuth(b"k" * 32)
    cache = kt.allocate_cache(LAYOUT, 8)
    receiver = kt.create_receiver("grpc", cache, LAYOUT, auth=auth)
    try:
        hello = HandshakeRequest(LAYOUT, "rogue").to_pb()
        stolen = auth.handshake_proof("someone-else")  # a proof for another sender id
        with grpc.insecure_channel(receiver.endpoint) as channel:
            stub = kvpb_grpc.KVTransferStub(channel)
            for metadata in (None, (("x-tandem-kv-proof", "1.2.3"),),
                             (("x-tandem-kv-proof", KVAuth(b"z" * 32).handshake_proof("rogue")),),
                             (("x-tandem-kv-proof", stolen),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Handshake(hello, timeout=5, metadata=metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "layout" not in refused.value.details()
        assert receiver.stats().auth_rejected == 4
        stale = auth.handshake_proof("rogue", now=time.time() - 3600)
        assert not auth.handshake_ok("rogue", stale) and auth.handshake_ok("rogue", auth.handshake_proof("rogue"))
        plain = kt.create_sender("grpc", connect_timeout_s=5.0)  # no secret: refused, counted
        with pytest.raises(kt.KVTransferError, match="UNAUTHENTICATED"):
            plain.connect(receiver.endpoint, LAYOUT)
        plain.close()
        assert receiver.stats().auth_rejected == 5
        sender = kt.create_sender("grpc", auth=auth)
        sender.connect(receiver.endpoint, LAYOUT)  # with the secret: the layout matches
        sender.close()
        assert receiver.stats().auth_rejected == 5
    finally:
        receiver.close()
        cache.close()


# ---- a real cluster -----------------------------------------------------------------------------


def _rogue_worker(model_dir, registry: str, secret: bytes | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in worker_env().items() if k != "TANDEM_CLUSTER_SECRET"}
    if secret is not None:
        env["TANDEM_CLUSTER_SECRET"] = secret.decode()
    return subprocess.run(
        [sys.executable, "-m", "decode_node", "--model", str(model_dir), "--port", str(free_port()),
         "--coordinator", registry, "--worker-id", "rogue", "--kv-cache-gb", "0.01"],
        env=env, capture_output=True, text=True, timeout=120)


def _kv_received(cluster) -> int:
    return sum((w["kv"] or {}).get("bytes_received", 0) for w in cluster.workers()
               if w["role"] == "decode")


def _kv_rejected(cluster) -> int:
    return sum((w["kv"] or {}).get("auth_rejected", 0) for w in cluster.workers()
               if w["role"] == "decode")


def test_a_cluster_with_a_secret_serves_and_refuses_what_lacks_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    model_dir = make_tiny_hf_model(tmp_path / "m", "llama")
    with running_cluster(model_dir, tmp_path / "logs", prefill_threshold=1,
                         worker_args=("--kv-cache-gb", "0.05"),
                         cluster_secret=SECRET.decode()) as cluster:
        assert all(SECRET.decode() not in " ".join(s.argv) for s in cluster.handle.specs)
        reply = cluster.chat([{"role": "user", "content": "Tell me about rivers, please."}],
                             options={"num_predict": 4, "temperature": 0})
        assert reply["done"] and reply["eval_count"] >= 1
        assert reply["tandem"]["prefill_worker"] == "prefill-0"  # its KV went over CURVE
        deadline = time.monotonic() + 20  # counters come with the next heartbeat
        while not _kv_received(cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _kv_received(cluster) > 0

        registry = next(s.argv[s.argv.index("--coordinator") + 1] for s in cluster.handle.specs
                        if "--coordinator" in s.argv)
        for secret, why in ((None, "no cluster proof"), (OTHER, "wrong cluster proof")):
            done = _rogue_worker(model_dir, registry, secret)
            assert done.returncode == 1, done.stderr[-2000:]
            assert "Error: registration refused" in done.stderr and why in done.stderr
        assert "rogue" not in {w["worker_id"] for w in cluster.workers()}

        # Straight to a worker: refused without the coordinator's proof; health stays open.
        [prefill] = [w for w in cluster.workers() if w["role"] == "prefill"]
        with grpc.insecure_channel(prefill["address"]) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.PrefillWorkerStub(channel).Status(pb.StatusRequest(), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        # Straight to the decode worker's KV receiver, without CURVE: counted, surfaced.
        [decode] = [w for w in cluster.workers() if w["role"] == "decode"]
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(decode["kv_endpoint"])
        _send_unanswered(rogue, _rogue_frames("nobody"))
        deadline = time.monotonic() + 20  # counters come with the next heartbeat
        while not _kv_rejected(cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        rogue.close()
        ctx.term()
        assert _kv_rejected(cluster) > 0
        refused = 'tandem_grpc_refused_calls_total{method="/tandem.worker.PrefillWorker/Status",' \
                  'process="prefill-0",reason="no_proof"}'
        deadline = time.monotonic() + 20  # the prefill worker's count comes with a heartbeat
        while True:
            with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            if refused in text or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert 'tandem_worker_kv_auth_rejected_total{' in text and refused in text
        assert ('tandem_grpc_refused_calls_total{method="/tandem.worker.Registry/Register",'
                'process="coordinator",reason="wrong_secret"}') in text
        again = cluster.chat([{"role": "user", "content": "And about lakes?"}],
                             options={"num_predict": 2, "temperature": 0})
        assert again["done"]


# ---- distribution by the launchers --------------------------------------------------------------


def test_launch_and_serve_hand_every_process_the_secret_but_no_command_line(tmp_path):
    from deploy.launch import plan_launch
    from deploy.process_plan import plan
    from deploy.local_topology import Topology
    from deploy.topology import TopologyError, parse_topology, tomllib

    base = ('model = "tiny"\n[coordinator]\nhost = "127.0.0.1"\nport = 11434\n'
            '[[prefill]]\nhost = "127.0.0.1"\nport = 50061\n'
            '[[decode]]\nhost = "127.0.0.1"\nport = 50071\n')
    security = ('[security]\ncluster_secret_file = "secret"\ntls_cert = "/pki/node.pem"\n'
                'tls_key = "/pki/node.key"\ntls_ca = "/pki/ca.pem"\n')
    t = parse_topology(tomllib.loads(base + security), tmp_path / "cluster.toml")
    specs, _ = plan_launch(t, tmp_path, "run")
    want = f"--cluster-secret-file {tmp_path / 'secret'} --tls-ca /pki/ca.pem " \
           "--tls-cert /pki/node.pem --tls-key /pki/node.key"
    assert [s.name for s in specs] == ["coordinator", "prefill-0", "decode-0"]
    assert all(want in " ".join(s.argv) for s in specs)
    with pytest.raises(TopologyError, match="tls_cert, tls_key and tls_ca together"):
        parse_topology(tomllib.loads(base + '[security]\ntls_cert = "c.pem"\n'), tmp_path / "t.toml")
    with pytest.raises(TopologyError, match="unknown"):
        parse_topology(tomllib.loads(base + '[security]\nsecret = "in the clear"\n'),
                       tmp_path / "t.toml")

    topology = Topology(model="tiny", model_path=tmp_path / "tiny.gguf", log_dir=tmp_path,
                        cluster_secret=SECRET.decode())
    specs, _ = plan(topology, port_picker=iter(range(40000, 40100)).__next__)
    assert SECRET.decode() not in repr(topology)
    for spec in specs:
        assert dict(spec.env)["TANDEM_CLUSTER_SECRET"] == SECRET.decode(), spec.name
        assert SECRET.decode() not in " ".join(spec.argv) and SECRET.decode() not in repr(spec)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_grpc_kv_backend_is_mutual_tls_with_the_cluster_files(tmp_path, secret):
    ca = make_ca(tmp_path / "ca")
    node = issue(tmp_path, ca, "node")
    auth = kv_auth_from(ClusterAuth(secret, TLSFiles(node.cert, node.key, node.ca)))
    assert auth.tls and auth.keyed == (secret is not None)
    cache = kt.allocate_cache(LAYOUT, 8)
    receiver = kt.create_receiver("grpc", cache, LAYOUT, auth=auth)
    try:
        with grpc.insecure_channel(receiver.endpoint) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                kvpb_grpc.KVTransferStub(channel).Handshake(
                    HandshakeRequest(LAYOUT, "rogue").to_pb(), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        plain = kt.create_sender("grpc", connect_timeout_s=2.0)
        with pytest.raises(kt.KVTransferError, match="handshake"):
            plain.connect(receiver.endpoint, LAYOUT)
        plain.close()
        receiver.expect("t1", [0, 1], LAYOUT.num_layers, 30.0)
        _honest_grpc_transfer(receiver, cache, auth)
    finally:
        receiver.close()
        cache.close()
