"""Property tests over the wire formats: KV transfer messages (kvtransfer/message.py), the
receiver's one path into the cache (ReceiveTable.ingest), and protobuf sent raw to every gRPC
service of running servers.

Rules: decoding any bytes either raises MessageError or gives a message that round-trips;
ingest never raises, and writes into the cache exactly when the unit is valid; malformed
protobuf gets a status (never UNKNOWN, the status of an exception the handler did not catch;
never a traceback in the details), and the server answers a valid call right after.
"""

from __future__ import annotations

import logging
import random

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.rpc import tandem_pb2
from reliability import fuzz
from common.rpc import worker_pb2
from kvtransfer import message as m
from kvtransfer.grpc_backend import GrpcReceiver
from kvtransfer.layout import KVLayout, allocate_cache
from kvtransfer.pb import kvtransfer_pb2
from kvtransfer.receive_table import ReceiveTable
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, harness_on_thread, load_model, make_tiny_model_dir,
)

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32",
                  model_id="fuzz")
SEEDS = fuzz.frame_seeds()
KINDS = sorted(SEEDS)
UINT32 = st.integers(0, (1 << 32) - 1)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)  # protobuf: UTF-8


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.binary(max_size=300))
def test_any_bytes_decode_to_an_error_or_a_round_trip(kind, data):
    fuzz.check_frame(kind, data)  # raises on anything but MessageError or a round trip


@st.composite
def mutated(draw, kind: str) -> bytes:
    data = bytearray(SEEDS[kind])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "delete")))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        else:
            del data[at:at + draw(st.integers(1, 8))]
    return bytes(data)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data())
def test_mutated_encodings_decode_to_an_error_or_a_round_trip(kind, data):
    fuzz.check_frame(kind, data.draw(mutated(kind)))


@SETTINGS
@given(header=st.builds(
    m.KVHeader, transfer_id=TEXT.filter(bool), layer=UINT32,
    block_ids=st.lists(UINT32, max_size=8).map(tuple), dtype=TEXT,
    shape=st.lists(UINT32, max_size=6).map(tuple), fingerprint=TEXT, checksum=UINT32,
    seq=st.integers(0, (1 << 64) - 1), payload_nbytes=st.integers(0, (1 << 64) - 1),
    sender_error=TEXT, sender_id=TEXT, finish=st.booleans(),
    first_token=st.integers(-(1 << 31), (1 << 31) - 1), num_units=UINT32))
def test_every_header_round_trips_and_checks_only_with_message_errors(header):
    assert m.KVHeader.decode(header.encode()) == header
    try:
        header.check_against(LAYOUT, num_cache_blocks=8)
    except m.MessageError:
        pass


# ---- ReceiveTable.ingest ---------------------------------------------------------------------

GRANTED = (2, 3)  # the blocks the expected transfer "t1" may write, granted to sender "s"


@st.composite
def units(draw) -> tuple[m.KVHeader, bytes]:
    """A data unit that is valid field by field with some probability, else off in one or
    more fields: a transfer, a sender, a layer, blocks, a dtype, a shape, a size, a checksum."""
    def pick(good, bad):
        return draw(st.one_of(st.just(good), bad)) if draw(st.booleans()) else good

    blocks = tuple(draw(st.lists(st.sampled_from(GRANTED + (0, 7, 8, 1 << 20)), min_size=0,
                                 max_size=3, unique=draw(st.booleans()))))
    n = len(blocks)
    size = LAYOUT.payload_nbytes(n)
    payload = draw(st.binary(min_size=size, max_size=size))
    data = pick(payload, st.binary(max_size=size + 8))
    header = m.KVHeader(
        transfer_id=pick("t1", st.sampled_from(("t2", "x" * 300))),
        layer=pick(draw(st.integers(0, 1)), UINT32),
        block_ids=blocks, dtype=pick("float32", st.sampled_from(("bfloat16", "", "int8"))),
        shape=pick(LAYOUT.payload_shape(n), st.lists(UINT32, max_size=5).map(tuple)),
        fingerprint=pick(LAYOUT.fingerprint, TEXT), checksum=pick(m.checksum(data), UINT32),
        seq=draw(st.integers(0, 9)), payload_nbytes=pick(size, st.integers(0, 1 << 40)),
        sender_id=pick("s", st.just("intruder")))
    return header, data


def _valid(header: m.KVHeader, data: bytes) -> bool:
    """The oracle, written apart from ReceiveTable: what a unit must be to be written."""
    try:
        header.check_against(LAYOUT, 8)
    except m.MessageError:
        return False
    return (header.transfer_id == "t1" and header.sender_id == "s"
            and set(header.block_ids) <= set(GRANTED) and len(data) == header.payload_nbytes
            and m.checksum(data) == header.checksum)


@SETTINGS
@given(unit=units())
def test_ingest_writes_exactly_the_valid_units(unit):
    header, data = unit
    cache = allocate_cache(LAYOUT, num_blocks=8)
    table = ReceiveTable(cache, LAYOUT, lambda sender, msg: None, "fuzz")
    table.expect("t1", GRANTED, num_layers=2, deadline_s=60.0)
    table.ask("s", "t1")
    before = cache.tensor.clone()
    ack = table.ingest(header, data)  # never raises: every refusal is a nack
    assert isinstance(ack, m.Ack) and ack.seq == header.seq
    written = not torch.equal(before.view(torch.int32), cache.tensor.view(torch.int32))
    assert ack.ok == _valid(header, data), (ack, header)
    if not ack.ok:
        assert not written, f"a refused unit wrote into the cache: {ack.reason}"
    elif any(data):
        got = cache.tensor[header.layer][:, list(header.block_ids)].contiguous()
        assert bytes(m.tensor_bytes(got)) == data


# ---- protobuf over gRPC ----------------------------------------------------------------------

# Statuses a malformed request may get. UNKNOWN is a handler's uncaught exception; a status
# the servers raise on purpose is any other.
FAULT = grpc.StatusCode.UNKNOWN


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{service full name: address} for the coordinator's Registry and Tandem API, a fake
    decode and a fake prefill worker (the generated servicers the real workers use), and a
    gRPC KV receiver."""
    model = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    tokens = model.tokenizer.encode("Hello", add_special_tokens=False)

    async def setup(h):
        decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
        prefill = await h.add_worker("p1", "prefill", Script(tokens=tokens))
        return {"tandem.worker.Registry": h.registry_address,
                "tandem.v1.Tandem": f"127.0.0.1:{h.coordinator.grpc_port}",
                "tandem.worker.DecodeWorker": decode.address,
                "tandem.worker.PrefillWorker": prefill.address}

    cache = allocate_cache(LAYOUT, num_blocks=8)
    receiver = GrpcReceiver(cache, LAYOUT)
    with harness_on_thread(model, setup, prefill_threshold=10_000) as addresses:
        yield {**addresses, "tandem.kvtransfer.KVTransfer": receiver.endpoint}
    receiver.close()


SERVICES = {s.full_name: s for module in (worker_pb2, tandem_pb2, kvtransfer_pb2)
            for s in module.DESCRIPTOR.services_by_name.values()}
CALLS = [(service, method.name) for service in sorted(SERVICES)
         for method in SERVICES[service].methods]


def _stub(channel: grpc.Channel, method) -> callable:
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    return kind(path, request_serializer=None, response_deserializer=None)  # raw bytes


def _call(channel: grpc.Channel, method, payload: bytes, timeout_s: float = 2.0
          ) -> grpc.StatusCode:
    """The status of one call with `payload` as the raw request. A payload that happens to
    decode may start real work (a generation, a grant's long poll): DEADLINE_EXCEEDED then
    ends it, and counts as an answer like any other status but UNKNOWN."""
    stub = _stub(channel, method)
    request = iter([payload, payload]) if method.client_streaming else payload
    try:
        answer = stub(request, timeout=timeout_s)
        if method.server_streaming:
            for _ in zip(range(64), answer):  # a few events are enough; then hang up
                pass
            answer.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        details = exc.details() or ""
        assert "Traceback" not in details and '.py", line' not in details, details
        return exc.code()


def _payloads(method, rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, and a valid encoding of the request type with bytes flipped or cut."""
    valid = _sample_request(method).SerializeToString()
    out = [b"", b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f"]  # empty; bad varints; a huge length
    for _ in range(n):
        if rng.random() < 0.4 or not valid:
            out.append(rng.randbytes(rng.randrange(1, 80)))
            continue
        data = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            data[at] = rng.randrange(256)
        out.append(bytes(data[:rng.randrange(1, len(data) + 1)]))
    return out


def _sample_request(method):
    """A populated request of the method's input type (every scalar field set)."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(method.input_type)
    msg = cls()
    for field in method.input_type.fields:
        if field.type == field.TYPE_STRING:
            value = "x1"
        elif field.type == field.TYPE_BOOL:
            value = True
        elif field.type in (field.TYPE_BYTES,):
            value = b"ab"
        elif field.type in (field.TYPE_MESSAGE, field.TYPE_ENUM, field.TYPE_GROUP):
            continue
        elif field.type in (field.TYPE_FLOAT, field.TYPE_DOUBLE):
            value = 0.5
        else:
            value = 3
        if field.is_repeated:
            getattr(msg, field.name).extend([value, value])
        else:
            setattr(msg, field.name, value)
    return msg


def _still_serving(service: str, address: str) -> None:
    """A valid call right after: the server is up and answers it properly."""
    valid = {"tandem.worker.DecodeWorker": "Status", "tandem.worker.PrefillWorker": "Status",
             "tandem.v1.Tandem": "ListModels", "tandem.worker.Registry": "Heartbeat",
             "tandem.kvtransfer.KVTransfer": "Handshake"}[service]
    method = SERVICES[service].methods_by_name[valid]
    with grpc.insecure_channel(address) as channel:
        # All defaults: a well-formed message (a Handshake without a layout is refused by
        # the handler itself: INVALID_ARGUMENT).
        code = _call(channel, method, b"", timeout_s=DEADLINE_S)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.NOT_FOUND), (service, code)


@pytest.mark.parametrize("service,method_name", CALLS, ids=[f"{s}.{n}" for s, n in CALLS])
def test_malformed_protobuf_gets_a_status_and_the_server_keeps_serving(servers, service,
                                                                       method_name, caplog):
    caplog.set_level(logging.WARNING)
    method = SERVICES[service].methods_by_name[method_name]
    rng = random.Random(f"{service}/{method_name}")
    codes = []
    with grpc.insecure_channel(servers[service]) as channel:
        for payload in _payloads(method, rng, 40):
            code = _call(channel, method, payload)
            assert code != FAULT, f"{service}.{method_name} crashed on {payload.hex()}"
            codes.append(code)
    # Undecodable bytes are refused by the generated deserializer, before any handler.
    assert grpc.StatusCode.INTERNAL in codes or grpc.StatusCode.INVALID_ARGUMENT in codes, codes
    _still_serving(service, servers[service])
    # grpc.aio logs "Unexpected [DecodeError] raised by servicer method" with a traceback
    # for each undecodable request unless common/grpc_guard.py turns it into a status.
    errors = [r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]
