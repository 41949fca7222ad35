"""Two coordinators over one prefill and one decode worker, as `tandem launch` starts them from
[[coordinator]] tables (real processes, a tiny model, the authenticated plane): both answer;
SIGKILL of one mid-stream cuts its client's stream, the other answers every new request, and
the workers free the orphaned request's KV blocks (the decode worker sees its caller's gRPC
stream end). Every worker also lists a third coordinator that never answers (a listener that
accepts and stays silent), which must delay nothing."""

from __future__ import annotations

import json
import socket
import time

import httpx

from common.internal_http import get_internal
from common.sampling_params import SamplingParams
from deploy.launch import _print_endpoints, plan_launch
from deploy.local import LocalCluster
from deploy.process_plan import free_port
from deploy.topology import parse_topology, tomllib
from engine.config import CacheConfig, EngineConfig
from engine.generation import TextStream, chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_hf_model

SECRET = "0123456789abcdef" * 4
CONTENT = "the river and the city of the old king"
N = 12
LONG = 7000  # tokens of the stream that is cut: it must outlive the kill by far


def _topology(model, log_dir):
    p = [free_port() for _ in range(6)]
    text = f"""
model = "{model}"
prefill_threshold = 0
log_dir = "{log_dir}"
coordinator_args = ["--model-name", "tiny"]
worker_args = ["--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05"]
[[coordinator]]
host = "127.0.0.1"
port = {p[0]}
registry_port = {p[1]}
[[coordinator]]
host = "127.0.0.1"
port = {p[2]}
registry_port = {p[3]}
[[prefill]]
host = "127.0.0.1"
port = {p[4]}
[[decode]]
host = "127.0.0.1"
port = {p[5]}
"""
    return parse_topology(tomllib.loads(text), log_dir / "two.toml")


def _chat(url: str) -> dict:
    r = httpx.post(url + "/api/chat", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": CONTENT}], "stream": False,
        "options": {"temperature": 0, "num_predict": N}})
    assert r.status_code == 200, r.text
    return r.json()


def _pools(url: str) -> list[dict]:
    return [w for w in get_internal(url, SECRET, timeout=5)["workers"] if w["alive"]]


def _wait(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.1)


def test_two_coordinators_serve_alone_and_the_workers_free_a_killed_ones_requests(tmp_path):
    tiny = make_tiny_hf_model(tmp_path / "m", "llama", max_position=8192)
    reference = LLMEngine.from_path(tiny, EngineConfig(cache=CacheConfig(num_blocks=64)))
    ids = chat_prompt_ids(reference, [{"role": "user", "content": CONTENT}])
    expected = "".join(TextStream(reference, ids, SamplingParams(temperature=0.0, num_predict=N)))
    del reference

    t = _topology(tiny, tmp_path / "logs")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepted by the kernel, never answered: a coordinator host gone mute
    specs, ready = plan_launch(t, tmp_path / "logs", "run1", SECRET)
    for spec in specs[2:]:  # the workers: a third, silent coordinator after the two
        at = spec.argv.index("--coordinator") + 1
        spec.argv[at] += f",127.0.0.1:{silent.getsockname()[1]}"
    first, second = t.urls
    try:
        with LocalCluster(specs, ready, start_timeout_s=180) as cluster:
            cluster.start()  # ready: both coordinators list both workers live
            lines: list[str] = []
            _print_endpoints(t, SECRET, lines.append)
            assert any(f"clients use the list: {first},{second}" in line for line in lines), lines

            # Both answer on their own, the same greedy text, through the disaggregated path.
            for url in (first, second):
                answer = _chat(url)
                assert answer["message"]["content"] == expected
                assert answer["tandem"]["prefill_worker"] == "prefill-0"

            # A long stream through the first coordinator; the second sees (in the workers'
            # heartbeats) the decode worker's blocks taken by it.
            body = {"model": "tiny", "messages": [{"role": "user", "content": CONTENT}],
                    "max_tokens": LONG, "ignore_eos": True, "temperature": 0, "stream": True}
            events: list[str] = []
            error = None
            with httpx.stream("POST", first + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(60, read=30)) as r:
                assert r.status_code == 200
                lines_in = r.iter_lines()
                try:
                    for line in lines_in:
                        if line.startswith("data: "):
                            events.append(line[6:])
                            break
                    busy = _wait(lambda: [w for w in _pools(second) if w["role"] == "decode"
                                          and w["num_free_blocks"] < w["num_blocks"]],
                                 "the decode worker's blocks in use, seen by the other coordinator")
                    assert busy
                    cluster.children[0].process.kill()  # SIGKILL coordinator-0 mid-stream
                    cluster.children[0].process.wait(10)
                    for line in lines_in:
                        if line.startswith("data: "):
                            events.append(line[6:])
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    error = exc
            # The client's stream was cut: no final chunk, no [DONE], or a read error.
            assert events and "[DONE]" not in events, events[-3:]
            assert not any(json.loads(e)["choices"] and json.loads(e)["choices"][0].get("finish_reason")
                           for e in events if e != "[DONE]")
            assert error is not None or len(events) < LONG

            # The second coordinator answers every new request, right.
            for _ in range(3):
                assert _chat(second)["message"]["content"] == expected
            # The orphaned request's blocks come back: every pool full again, as the second
            # coordinator reads the workers' heartbeats.
            full = _wait(lambda: (lambda ws: ws if len(ws) == 2 and all(
                w["num_free_blocks"] == w["num_blocks"] for w in ws) else None)(_pools(second)),
                "every worker's KV pool full again")
            assert {w["worker_id"] for w in full} == {"prefill-0", "decode-0"}
    finally:
        silent.close()


def test_one_of_two_coordinators_that_exits_is_restarted_and_the_coordinators_stop_last(tmp_path):
    """The launcher's supervision (no model: sleeping processes in the roles' places)."""
    import sys

    from deploy.process_plan import ProcessSpec, Readiness

    def sleeper(name: str) -> ProcessSpec:
        return ProcessSpec(name, [sys.executable, "-c", "import time; time.sleep(60)"],
                           tmp_path / f"{name}.log")

    specs = [sleeper("coordinator-0"), sleeper("coordinator-1"), sleeper("decode-0")]
    ready = Readiness("http://127.0.0.1:1", {"decode": 1}, more_urls=("http://127.0.0.1:2",))
    cluster = LocalCluster(specs, ready, grace_s=5, restart_backoff_s=(0.05,))
    events: list[str] = []
    cluster.out = events.append
    with cluster:
        cluster.spawn()
        first = cluster.children[0].process  # the one the launcher polls first
        first.kill()
        first.wait(10)
        deadline = time.monotonic() + 30
        while not any(e.startswith("restarted coordinator-0") for e in events):
            assert cluster._supervise() is None  # the other coordinator serves on
            assert time.monotonic() < deadline, events
            time.sleep(0.05)
        assert cluster.children[0].process is not first and cluster.children[0].process.poll() is None
        assert cluster.children[1].process.poll() is None
    stopped = events[-1]
    assert stopped.startswith("stopped decode-0"), stopped  # workers first, coordinators last
    assert stopped.index("coordinator-0") > stopped.index("decode-0")
    assert stopped.index("coordinator-1") > stopped.index("decode-0")
