"""Request ids and logs: X-Request-Id accepted or made and returned, carried to the prefill and
decode workers, and on their log lines, so one grep of the three logs finds one request; JSON
log lines; the access log line and --no-access-log."""

from __future__ import annotations

import json
import logging
import time
import uuid

import grpc
import httpx
import pytest

from common import request_id
from common.log_format import RequestIdFilter
from common.rpc import tandem_pb2 as tpb
from common.rpc import tandem_pb2_grpc as tpb_grpc
from deploy.process_plan import free_port
from reliability.model_factory import make_tiny_hf_model
from tests.helpers.api_cluster import MODEL, WORKER_ARGS
from tests.helpers.cluster import running_cluster
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, coordinator_harness, load_model, make_tiny_model_dir, run,
)

LOGS = ("coordinator", "prefill-0", "decode-0")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
        "stream": False, "options": {"temperature": 0, "num_predict": 6}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("request-logs")
    model_dir = make_tiny_hf_model(root / "model", "llama")
    grpc_port = free_port()
    # prefill_threshold 0: every prompt is prefilled on the prefill worker, so one request
    # touches all three processes.
    with running_cluster(model_dir, root / "logs", model=MODEL, prefill_threshold=0,
                         worker_args=(*WORKER_ARGS, "--log-format", "json"),
                         coordinator_args=("--grpc-port", str(grpc_port),
                                           "--log-format", "json")) as c:
        c.grpc_target = f"127.0.0.1:{grpc_port}"
        yield c


def _lines(cluster, name: str) -> list[dict]:
    """Every line of a process's log, each parsed as JSON (a line that is not fails the test)."""
    text = (cluster.log_dir / f"{name}.log").read_text(errors="replace")
    lines = []
    for raw in text.splitlines():
        if raw.strip():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                pytest.fail(f"{name}.log has a line that is not JSON: {raw!r}")
    return lines


def _lines_about(cluster, rid: str, names=LOGS, timeout_s: float = 20.0,
                 access: bool = True) -> dict[str, list[dict]]:
    """Each log's lines with request_id `rid`, polled until every log has one and (access, an
    HTTP request) the coordinator's has its access line, or the deadline. The access line is
    written once the response ended, which the client may see first, and after the request's
    own summary line: waiting for any line let a streamed answer's check run before it."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {n: [line for line in _lines(cluster, n) if line.get("request_id") == rid]
                 for n in names}
        logged = not access or "coordinator" not in found or any(
            line["logger"] == "coordinator.access" for line in found["coordinator"])
        if (all(found.values()) and logged) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_one_request_id_ties_the_three_logs_together(cluster):
    rid = f"client-{uuid.uuid4().hex[:12]}"
    r = httpx.post(cluster.url + "/api/chat", json=CHAT, headers={"X-Request-Id": rid},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    found = _lines_about(cluster, rid)
    assert all(found.values()), {n: len(v) for n, v in found.items()}
    for lines in found.values():
        for line in lines:
            assert set(line) >= {"ts", "level", "logger", "msg", "request_id"}
    access = [line for line in found["coordinator"] if line["logger"] == "coordinator.access"]
    assert len(access) == 1 and '"POST /api/chat HTTP/1.1" 200' in access[0]["msg"]
    # uvicorn's own access log stays off: one line per request, ours.
    assert not any(line["logger"] == "uvicorn.access" for line in _lines(cluster, "coordinator"))
    assert access[0]["msg"].endswith(" ms") and "Name three rivers" not in access[0]["msg"]
    assert any("prompt +" in line["msg"] for line in found["coordinator"])  # the request's summary
    assert any(line["msg"].startswith("prefill ") for line in found["prefill-0"])
    assert any(line["msg"].startswith("generate ") for line in found["decode-0"])
    # The id is the client's alone: no other request's lines carry it.
    assert all(r.get("request_id") != rid or r in found[n] for n in LOGS for r in _lines(cluster, n))


def test_an_invalid_or_missing_id_is_replaced_and_every_answer_has_one(cluster):
    bad = httpx.post(cluster.url + "/api/chat", json=CHAT,
                     headers={"X-Request-Id": "two words"}, timeout=60)
    made = bad.headers["x-request-id"]
    assert bad.status_code == 200 and made != "two words" and request_id.valid(made) == made
    long = httpx.get(cluster.url + "/api/version",
                     headers={"X-Request-Id": "x" * (request_id.MAX_LENGTH + 1)}, timeout=10)
    assert len(long.headers["x-request-id"]) == 32
    missing = httpx.get(cluster.url + "/no/such/route", timeout=10)
    assert missing.status_code == 404 and len(missing.headers["x-request-id"]) == 32
    # Ids are made per request.
    again = httpx.get(cluster.url + "/no/such/route", timeout=10)
    assert again.headers["x-request-id"] != missing.headers["x-request-id"]
    (line,) = _lines_about(cluster, missing.headers["x-request-id"], ("coordinator",))["coordinator"]
    assert '"GET /no/such/route HTTP/1.1" 404' in line["msg"]


def test_a_streamed_answer_is_logged_once_it_ended(cluster):
    rid = f"stream-{uuid.uuid4().hex[:12]}"
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=60,
                      headers={"X-Request-Id": rid},
                      json={"model": MODEL, "messages": CHAT["messages"], "stream": True,
                            "max_tokens": 4, "temperature": 0}) as r:
        assert r.headers["x-request-id"] == rid
        body = "".join(r.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    found = _lines_about(cluster, rid)
    assert all(found.values())
    access = [line for line in found["coordinator"] if line["logger"] == "coordinator.access"]
    assert len(access) == 1 and '"POST /v1/chat/completions HTTP/1.1" 200' in access[0]["msg"]


def test_the_grpc_api_takes_and_returns_the_id_as_metadata(cluster):
    rid = f"grpc-{uuid.uuid4().hex[:12]}"
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        call = tpb_grpc.TandemStub(channel).Generate(
            tpb.GenerateRequest(model=MODEL, prompt="Name three rivers.",
                                options=tpb.Options(temperature=0, num_predict=4)),
            metadata=request_id.metadata(rid), timeout=60)
        responses = list(call)
        assert responses[-1].done
        assert dict(call.initial_metadata())[request_id.METADATA_KEY] == rid
    found = _lines_about(cluster, rid, access=False)  # gRPC: no HTTP access line
    assert found["prefill-0"] and found["decode-0"]


# ---- the access log line, in-process (fake workers) -----------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("access_log", [True, False])
def test_no_access_log_turns_the_line_off(model, caplog, access_log):
    caplog.handler.addFilter(RequestIdFilter())

    async def scenario():
        async with coordinator_harness(model, access_log=access_log) as h, \
                httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await client.get(f"{h.url}/api/version", headers={"X-Request-Id": "v-1"})

    with caplog.at_level(logging.INFO, logger="coordinator.access"):
        answer = run(scenario())
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "v-1"
    lines = [r for r in caplog.records if r.name == "coordinator.access"]
    if access_log:
        (line,) = lines
        assert '"GET /api/version HTTP/1.1" 200' in line.getMessage()
        assert line.request_id == "v-1"
    else:
        assert lines == []
