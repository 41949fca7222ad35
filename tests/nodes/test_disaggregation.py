"""tandem serve's topology for real: a coordinator, prefill and decode workers as separate
processes on 127.0.0.1, the KV cache crossing between them over each transfer backend.

Expected answers come from the single-process engine on the same model and formats: greedy
output through the disaggregated path must be the same text."""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.generation import TextStream, chat_prompt_ids
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from tests.helpers.cluster import running_cluster
from reliability.model_factory import make_tiny_hf_model

FP32 = ("--decode-quant", "fp32", "--prefill-quant", "fp32", "--kv-cache-gb", "0.05")
WORDS = "the of and to in is was for on that with as by it at from his an were are which this".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama", max_position=4096)


@pytest.fixture(scope="module")
def reference(tiny) -> LLMEngine:
    return LLMEngine.from_path(tiny, EngineConfig(cache=CacheConfig(num_blocks=1024)))


def text_prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def expected_text(engine: LLMEngine, content: str, n: int) -> str:
    ids = chat_prompt_ids(engine, [{"role": "user", "content": content}])
    return "".join(TextStream(engine, ids, SamplingParams(temperature=0.0, num_predict=n)))


def chat(cluster, content: str, n: int, timeout: float = 180) -> dict:
    return cluster.chat([{"role": "user", "content": content}], timeout=timeout,
                        options={"temperature": 0, "num_predict": n})


def assert_pools_full(cluster) -> None:
    workers = cluster.wait_pools_full()
    assert workers and all(w["num_free_blocks"] == w["num_blocks"] for w in workers), workers


@pytest.mark.parametrize("backend", ["zmq", "shm", "grpc", "dist"])
def test_greedy_through_each_backend_equals_single_process(tiny, reference, tmp_path, backend):
    contents = [text_prompt(n, seed=n) for n in (3, 40, 150)]
    with running_cluster(tiny, tmp_path / "logs", kv_backend=backend, prefill_threshold=1,
                         chunk_size=64, worker_args=FP32) as cluster:
        for content in contents:
            reply = chat(cluster, content, 12)
            assert reply["tandem"]["prefill_worker"] == "prefill-0"  # prefilled remotely
            assert reply["message"]["content"] == expected_text(reference, content, 12)
        assert_pools_full(cluster)


@pytest.fixture(scope="module")
def reference_bf16(tiny) -> LLMEngine:
    return LLMEngine.from_path(tiny, EngineConfig(
        cache=CacheConfig(num_blocks=1024, kv_dtype="bf16")))


@pytest.mark.parametrize("backend", ["zmq", "shm", "grpc", "dist"])
def test_bf16_kv_through_each_backend_equals_single_process_bf16(tiny, reference_bf16, tmp_path, backend):
    contents = [text_prompt(n, seed=100 + n) for n in (3, 40, 150)]
    with running_cluster(tiny, tmp_path / "logs", kv_backend=backend, prefill_threshold=1, chunk_size=64,
                         worker_args=FP32 + ("--kv-dtype", "bf16")) as cluster:
        layouts = {w["role"]: w["kv_layout_fingerprint"] for w in cluster.workers()}
        assert set(layouts) == {"prefill", "decode"} and len(set(layouts.values())) == 1
        assert layouts["decode"].startswith("bfloat16 "), layouts
        for content in contents:
            reply = chat(cluster, content, 12)
            assert reply["tandem"]["prefill_worker"] == "prefill-0"  # the KV crossed over
            assert reply["message"]["content"] == expected_text(reference_bf16, content, 12)
        assert_pools_full(cluster)


def test_prefill_and_decode_with_different_kv_dtypes_are_refused_at_registration(tiny, tmp_path):
    from deploy.local import LaunchError, LocalCluster
    from deploy.process_plan import free_port, plan
    from deploy.local_topology import Topology

    topology = Topology(model=str(tiny), model_path=tiny, log_dir=tmp_path, port=free_port(),
                        worker_args=FP32, coordinator_args=("--model-name", "tiny"))
    specs, ready = plan(topology)
    assert [s.name for s in specs] == ["coordinator", "prefill-0", "decode-0"]
    specs[2].argv.extend(["--kv-dtype", "bf16"])  # the last flag wins: decode holds bf16 KV
    with LocalCluster(specs, ready, start_timeout_s=120) as cluster:
        with pytest.raises(LaunchError) as info:
            cluster.start()
    message = str(info.value)  # whichever registered second is refused, and exits
    assert "registration refused: KV layout fingerprint" in message, message
    assert "differs from the live workers'" in message and "could not pair" in message
    assert "'bfloat16 " in message or "'float32 " in message, message
    assert "(bfloat16 " in message or "(float32 " in message, message


def test_thirty_two_concurrent_mixed_requests(tiny, reference, tmp_path):
    rng = random.Random(7)
    lengths = [rng.choice([5, 10, 40, 200, 700, 1400]) for _ in range(32)]
    contents = [text_prompt(n, seed=i) for i, n in enumerate(lengths)]
    expected = [expected_text(reference, c, 8) for c in contents]
    with running_cluster(tiny, tmp_path / "logs", chunk_size=256, worker_args=FP32) as cluster:
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda c: chat(cluster, c, 8), contents))
        assert [r["message"]["content"] for r in replies] == expected
        assert {r["tandem"]["prefill_worker"] for r in replies} == {None, "prefill-0"}  # both paths used
        assert max(r["prompt_eval_count"] for r in replies) > 2000
        assert_pools_full(cluster)


def stream_chat(cluster, content: str, n: int):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}],
                       "options": {"temperature": 0, "num_predict": n}}).encode()
    req = urllib.request.Request(cluster.url + "/api/chat", data=body, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120)


def kill(cluster, name: str) -> None:
    child = next(c for c in cluster.handle.children if c.spec.name == name)
    child.process.send_signal(signal.SIGKILL)
    child.process.wait(10)


def serving_decode_worker(cluster, timeout_s: float = 10.0) -> str:
    """The decode worker the coordinator routed the open request to."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [w["worker_id"] for w in cluster.workers()
                if w["role"] == "decode" and w["assigned_requests"] > 0]
        if busy:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("no decode worker reported the running request")


def stream_through_a_fault(cluster, reference, seed: int, fault) -> tuple[str, str]:
    """A 1,500-token greedy stream; `fault(victim)` hits the decode worker serving it once its
    first token is out. The request moves to the other decode worker and the stream ends there
    with the single-process text, one migration, no error. Returns (victim, survivor)."""
    content = text_prompt(30, seed)
    n = 1500
    want = expected_text(reference, content, n)
    stream = stream_chat(cluster, content, n)
    first = json.loads(stream.readline())
    assert first["done"] is False
    victim = serving_decode_worker(cluster)
    survivor = ({"decode-0", "decode-1"} - {victim}).pop()
    fault(victim)
    lines = [first] + [json.loads(line) for line in stream if line.strip()]
    assert "error" not in lines[-1], lines[-1]
    assert "".join(line["message"]["content"] for line in lines) == want
    final = lines[-1]
    assert final["done"] is True and final["tandem"]["decode_worker"] == survivor
    assert final["tandem"]["migrations"] == 1
    return victim, survivor


def test_killed_decode_worker_mid_stream_migrates_and_the_stream_completes(tiny, reference, tmp_path):
    """kill -9 the decode worker serving a stream: the coordinator places the request again on
    the survivor with the prompt plus the tokens generated so far (re-prefilled on the prefill
    worker), and the client's stream goes on to the single-process greedy text, no error."""
    with running_cluster(tiny, tmp_path / "logs", decode=2, chunk_size=64, worker_args=FP32) as cluster:
        victim, survivor = stream_through_a_fault(cluster, reference, 1, lambda v: kill(cluster, v))
        state = {w["worker_id"]: w["alive"] for w in cluster.workers()}
        assert state[victim] is False and state[survivor] is True
        assert_pools_full(cluster)  # the survivors': prefill-0 and the new decode worker
        content = text_prompt(20, seed=100)
        reply = chat(cluster, content, 6)
        assert reply["tandem"]["decode_worker"] == survivor
        assert reply["message"]["content"] == expected_text(reference, content, 6)


def test_frozen_decode_worker_mid_stream_is_declared_dead_and_the_stream_moves(tiny, reference, tmp_path):
    """SIGSTOP the decode worker serving a stream: nothing is cut (the process lives, its
    sockets stay open), so only its silence tells. At the heartbeat deadline the registry
    declares it dead and ends its calls; the request moves to the survivor and the stream goes
    on to the greedy text, long before the token timeout. Thawed, the worker registers again
    with every block free."""
    with running_cluster(tiny, tmp_path / "logs", decode=2, chunk_size=64, worker_args=FP32) as cluster:
        stopped = []

        def freeze(victim: str) -> None:
            process = next(c for c in cluster.handle.children if c.spec.name == victim).process
            process.send_signal(signal.SIGSTOP)
            stopped.append(process)
        try:
            victim, _ = stream_through_a_fault(cluster, reference, 2, freeze)
            state = {w["worker_id"]: w for w in cluster.workers()}
            assert state[victim]["alive"] is False and "no heartbeat" in state[victim]["dead_reason"]
        finally:
            for process in stopped:
                process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not {w["worker_id"]: w["alive"] for w in cluster.workers()}[victim]:
            assert time.monotonic() < deadline, "the thawed worker did not register again"
            time.sleep(0.2)
        assert_pools_full(cluster)  # the thawed worker freed the blocks of the moved request


def test_killed_prefill_worker_is_routed_around(tiny, reference, tmp_path):
    with running_cluster(tiny, tmp_path / "logs", prefill=2, prefill_threshold=1, chunk_size=64,
                         worker_args=FP32) as cluster:
        kill(cluster, "prefill-0")
        for i in range(4):
            content = text_prompt(60 + i, seed=200 + i)
            reply = chat(cluster, content, 6)
            assert reply["tandem"]["prefill_worker"] == "prefill-1"
            assert reply["message"]["content"] == expected_text(reference, content, 6)
        state = {w["worker_id"]: w["alive"] for w in cluster.workers()}
        assert state["prefill-0"] is False
        assert_pools_full(cluster)


@pytest.mark.model
@pytest.mark.parametrize("backend", ["zmq", "dist"])
def test_default_model_disaggregated_equals_single_process(default_gguf, tmp_path, backend):
    engine = LLMEngine.from_path(default_gguf, EngineConfig.for_role(
        "colocated", "int4", "fp32", cache=CacheConfig(num_blocks=256)))
    questions = ["List four primary colors.", "What is continuous batching?",
                 "Summarize: " + text_prompt(120, seed=3)]
    expected = [expected_text(engine, q, 24) for q in questions]
    del engine
    with running_cluster(default_gguf, tmp_path / "logs", model="smollm2", prefill_threshold=1,
                         kv_backend=backend, worker_args=("--kv-cache-gb", "0.2")) as cluster:
        for q, want in zip(questions, expected):
            reply = cluster.chat([{"role": "user", "content": q}], model="smollm2",
                                 options={"temperature": 0, "num_predict": 24})
            assert reply["tandem"]["prefill_worker"] == "prefill-0"
            assert reply["message"]["content"] == want
        # Issue 15: this request made the sampler raise, which took the whole cluster down.
        # It is a 400 now, and the same cluster gives the greedy answer right after.
        hostile = json.dumps({"model": "smollm2", "prompt": "hi",
                              "options": {"temperature": 1e308}}).encode()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(
                cluster.url + "/api/generate", data=hostile,
                headers={"Content-Type": "application/json"}), timeout=60)
        assert info.value.code == 400
        assert "option 'temperature'" in json.loads(info.value.read())["error"]
        reply = cluster.chat([{"role": "user", "content": "What is the capital of France?"}],
                             model="smollm2", options={"temperature": 0, "num_predict": 16})
        assert "Paris" in reply["message"]["content"], reply
        assert_pools_full(cluster)


def test_killed_worker_is_restarted_by_the_supervisor_and_serves_again(tiny, reference, tmp_path):
    """kill -9 the only decode worker while `tandem serve`'s supervisor runs (LocalCluster.wait):
    it is started again, re-registers, and the same request gets the same answer; the
    coordinator process never changed."""
    import threading

    content = text_prompt(12, seed=3)
    with running_cluster(tiny, tmp_path / "logs", worker_args=FP32) as cluster:
        cluster.handle.restart_backoff_s = (0.2,)
        cluster.handle.out = lambda line: None
        before = chat(cluster, content, 8)["message"]["content"]
        coordinator = cluster.handle.children[0].process
        supervisor = threading.Thread(target=cluster.handle.wait, kwargs={"poll_s": 0.1})
        supervisor.start()
        try:
            old = next(c for c in cluster.handle.children if c.spec.name == "decode-0").process
            kill(cluster, "decode-0")
            deadline = time.monotonic() + 60
            log = cluster.log_dir / "decode-0.log"
            while time.monotonic() < deadline:
                new = next(c for c in cluster.handle.children if c.spec.name == "decode-0").process
                alive = {w["worker_id"]: w["alive"] for w in cluster.workers()}
                # The new process has registered (its log says so twice: both lives append).
                if (new.pid != old.pid and log.read_text().count("registered with") == 2
                        and alive.get("decode-0")):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"decode-0 did not come back: {cluster.workers()}")
            assert chat(cluster, content, 8)["message"]["content"] == before == expected_text(reference, content, 8)
            assert cluster.handle.children[0].process is coordinator and coordinator.poll() is None
            assert_pools_full(cluster)
        finally:
            cluster.handle.stop_requested.set()
            supervisor.join(10)


def test_shared_prefix_moves_only_new_blocks_and_lands_where_it_is_cached(tiny, reference, tmp_path):
    """Two requests share a long prefix (a system prompt, an earlier turn). The second goes to
    the decode worker whose prefix cache holds it (workers publish their block hashes in
    heartbeats), which reserves the shared blocks from its cache and is sent only the blocks
    it lacks; the prefill worker computes only the new part too."""
    prefix = text_prompt(600, seed=21)
    first, second = prefix + " and so on", prefix + " then what"
    ids = [chat_prompt_ids(reference, [{"role": "user", "content": c}]) for c in (first, second)]
    common = next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)
    assert common >= 512
    cfg = reference.config.model
    per_block = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 KV
    blocks = [-(-len(p) // 16) for p in ids]
    shared = min(common, len(ids[1]) - 1) // 16  # full blocks, the last token always computed
    with running_cluster(tiny, tmp_path / "logs", decode=2, prefill_threshold=1, chunk_size=256,
                         worker_args=FP32) as cluster:
        a = chat(cluster, first, 4)
        holder = a["tandem"]["decode_worker"]
        assert a["tandem"]["kv_bytes"] == blocks[0] * per_block  # a cold cache: every block moves
        deadline = time.monotonic() + 15  # the next heartbeat publishes its cached blocks
        while not any(w["worker_id"] == holder and w["cached_blocks"] >= shared
                      for w in cluster.workers()):
            assert time.monotonic() < deadline, cluster.workers()
            time.sleep(0.1)
        b = chat(cluster, second, 4)
        assert b["tandem"]["decode_worker"] == holder
        assert b["tandem"]["kv_bytes"] == (blocks[1] - shared) * per_block
        assert b["message"]["content"] == expected_text(reference, second, 4)
        assert b["tandem"]["cached_tokens"] >= shared * 16  # the prefill worker's own cache
        with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        want = f'tandem_kv_transfer_bytes_per_request_sum{{worker="{holder}"}} '
        line = next(x for x in metrics.splitlines() if x.startswith(want))
        assert float(line.split()[-1]) == (blocks[0] + blocks[1] - shared) * per_block
        assert_pools_full(cluster)
