"""`tandem serve --load-on-request --model-memory-budget B` as processes: the CLI itself, one
pinned model given with --model, and three tiny random models in a fake Ollama store on disk
that no --model names. Through the real `ollama` client: a model that is not loaded loads on
its first request and answers with its own greedy output, appears in /api/ps, and a second one
over the budget unloads the idle first one (its worker process gone, its records gone from the
registry); two concurrent first requests (two spellings) start it once; keep_alive 0 stops its
workers; a model larger than what the budget leaves is a 503 naming the budget; a name no
store holds stays Ollama's 404 and OpenAI's model_not_found."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import ollama
import openai
import pytest

from common.internal_http import get_internal
from common.sampling_params import SamplingParams
from deploy.process_plan import free_port
from engine.config import CacheConfig, EngineConfig
from engine.generation import TextStream, chat_prompt_ids
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_gguf
from tests.helpers.foreign_stores import make_ollama_store

MESSAGES = [{"role": "user", "content": "the river and the city of the old king"}]
N = 8
OPTIONS = {"temperature": 0, "num_predict": N}
SECRET = "on-request-test-secret-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def _greedy(path: Path) -> str:
    engine = LLMEngine.from_path(path, EngineConfig(cache=CacheConfig(num_blocks=64)))
    ids = chat_prompt_ids(engine, MESSAGES)
    return "".join(TextStream(engine, ids, SamplingParams(temperature=0.0, num_predict=N)))


def _workers(url: str) -> list[dict]:
    return get_internal(url, SECRET)["workers"]


def _ps(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/api/ps", timeout=10) as r:
        return sorted(m["name"] for m in json.loads(r.read())["models"])


def _worker_pids(launcher: int, worker_id: str) -> list[int]:
    """Processes the launcher started for `worker_id` that still exist (not zombies)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == launcher and worker_id.encode() in argv:
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("onload")
    pinned = make_tiny_gguf(root / "pinned.gguf", seed=0).path
    models = {"alpha": make_tiny_gguf(root / "alpha.gguf", seed=1).path,
              "beta": make_tiny_gguf(root / "beta.gguf", seed=2).path,
              # Within the budget alone, not beside the pinned model.
              "medium": make_tiny_gguf(root / "medium.gguf", seed=3, layers=4).path,
              # Larger than the whole budget.
              "big": make_tiny_gguf(root / "big.gguf", seed=4, hidden=128, layers=4,
                                    intermediate=256).path}
    expected = {name: _greedy(models[name]) for name in ("alpha", "beta")}
    assert expected["alpha"] != expected["beta"]  # else the routing checks prove nothing
    store = root / "ollama"
    for name, path in {"pinned": pinned, **models}.items():
        make_ollama_store(store, path, name=f"library/{name}", params={}, system=None)
    small = max(models["alpha"].stat().st_size, models["beta"].stat().st_size)
    budget = pinned.stat().st_size + small + 1024  # the pinned model and one of alpha, beta
    assert models["medium"].stat().st_size < budget < (pinned.stat().st_size
                                                       + models["medium"].stat().st_size)
    assert models["big"].stat().st_size > budget
    assert budget < pinned.stat().st_size + models["alpha"].stat().st_size + models["beta"].stat().st_size
    port = free_port()
    log = open(root / "serve.log", "wb")
    env = {**os.environ, "OLLAMA_MODELS": str(store), "TANDEM_CLUSTER_SECRET": SECRET,
           "OLLAMA_KEEP_ALIVE": "-1"}  # only eviction and keep_alive 0 unload here
    serve = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "serve", "--model", "pinned", "--colocated",
         "--port", str(port), "--grpc-port", "0", "--num-blocks", "64", "--decode-quant",
         "fp32", "--prefill-quant", "fp32", "--log-dir", str(root / "logs"),
         "--load-on-request", "--model-memory-budget", str(budget), "--start-timeout", "240"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a hang guard: the pinned worker loads first
        while True:
            assert serve.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                if any(w["alive"] for w in _workers(url)):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        yield url, serve, expected, root / "serve.log"
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        log.close()


def test_models_load_on_request_within_the_budget_and_unload(served):
    url, serve, expected, log = served
    client = ollama.Client(host=url, timeout=300)
    assert _ps(url) == ["pinned:latest"]

    # alpha is in the store, not served: its first request loads it, and it answers as itself.
    reply = client.chat(model="alpha", messages=MESSAGES, options=OPTIONS)
    assert (reply.model, reply.message.content) == ("alpha", expected["alpha"])
    assert reply.load_duration > 0
    assert _ps(url) == ["alpha:latest", "pinned:latest"]
    alpha_pids = _worker_pids(serve.pid, "alpha-colocated-0")
    assert len(alpha_pids) == 1
    again = client.chat(model="alpha:latest", messages=MESSAGES, options=OPTIONS)
    assert again.message.content == expected["alpha"]

    # beta does not fit beside alpha: alpha is idle, so it is unloaded first. Two first
    # requests at once, by two spellings, start beta once.
    answers: dict[str, str] = {}

    def ask(name: str) -> None:
        answers[name] = client.chat(model=name, messages=MESSAGES, options=OPTIONS).message.content

    threads = [threading.Thread(target=ask, args=(n,)) for n in ("beta", "beta:latest")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # a hang guard
    assert answers == {"beta": expected["beta"], "beta:latest": expected["beta"]}
    assert _ps(url) == ["beta:latest", "pinned:latest"]
    assert log.read_text().count("loading beta on request") == 1
    ids = {w["worker_id"] for w in _workers(url)}
    assert ids == {"colocated-0", "beta-colocated-0"}  # alpha's records are gone
    assert not any(Path(f"/proc/{pid}").exists() for pid in alpha_pids)  # stopped and reaped

    # medium cannot fit even beside the pinned model alone: a 503 naming the budget and
    # what holds it, and beta is not unloaded for it in vain; big is over the whole budget.
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="medium", messages=MESSAGES, options=OPTIONS)
    assert refused.value.status_code == 503
    assert "budget" in str(refused.value) and "pinned" in str(refused.value)
    assert _ps(url) == ["beta:latest", "pinned:latest"]
    with pytest.raises(ollama.ResponseError) as too_big:
        client.chat(model="big", messages=MESSAGES, options=OPTIONS)
    assert too_big.value.status_code == 503
    assert "larger than the model memory budget" in str(too_big.value)

    # keep_alive 0 unloads beta: its worker stops, /api/ps no longer lists it.
    beta_pids = _worker_pids(serve.pid, "beta-colocated-0")
    assert len(beta_pids) == 1
    done = client.generate(model="beta", keep_alive=0)
    assert done.done_reason == "unload"
    # The stop runs after the answer; a worker that has exited is a zombie until the launcher's
    # wait() reaps it, so wait for its /proc entry itself (60 s: a hang guard).
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in beta_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in beta_pids)
    assert _ps(url) == ["pinned:latest"]
    assert {w["worker_id"] for w in _workers(url)} == {"colocated-0"}

    # alpha, unloaded for beta, loads again; the pinned model answered throughout.
    assert client.chat(model="alpha", messages=MESSAGES,
                       options=OPTIONS).message.content == expected["alpha"]
    assert client.chat(model="pinned", messages=MESSAGES, options=OPTIONS).model == "pinned"
    assert {w["worker_id"] for w in _workers(url)} == {"colocated-0", "alpha-colocated-0"}
    assert _pools_full(url)  # every KV block of the live workers is free again


def _pools_full(url: str, timeout_s: float = 20.0) -> bool:
    """Heartbeats carry the free-block counts, so they lag a request's end: poll."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(w["num_free_blocks"] == w["num_blocks"] for w in _workers(url) if w["alive"]):
            return True
        time.sleep(0.2)
    return False


def test_a_name_no_store_holds_is_each_apis_404(served):
    url, _, _, _ = served
    client = ollama.Client(host=url, timeout=60)
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="gamma", messages=MESSAGES)
    assert refused.value.status_code == 404
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.chat.completions.create(model="gamma", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    # A path is never probed for a client's name, even one that exists on the server.
    with pytest.raises(ollama.ResponseError) as by_path:
        client.chat(model=str(ROOT / "README.md"), messages=MESSAGES)
    assert by_path.value.status_code == 404
