"""The local launcher: process plan, start-up with a real coordinator process and fake worker
processes, failure reporting, and stopping every child."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from deploy.local import LaunchError, LocalCluster
from deploy.process_plan import ProcessSpec, plan
from deploy.local_topology import Topology
from tests.helpers.coordinator_fakes import free_port, make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]


def ports():
    n = iter(range(20000, 20100))
    return lambda: next(n)


def test_plan_disaggregated(tmp_path):
    t = Topology(model="smollm2", model_path=tmp_path / "m.gguf", log_dir=tmp_path / "logs",
                 prefill=2, decode=1, kv_backend="shm", chunk_size=256, prefill_threshold=32)
    specs, ready = plan(t, ports())
    assert [s.name for s in specs] == ["coordinator", "prefill-0", "prefill-1", "decode-0"]
    coord = specs[0].argv
    assert coord[1:3] == ["-m", "coordinator"]
    assert coord[coord.index("--registry-port") + 1] == "20000"
    assert coord[coord.index("--prefill-threshold") + 1] == "32"
    assert coord[coord.index("--model") + 1] == "smollm2"
    worker_ports = set()
    for spec in specs[1:]:
        argv = spec.argv
        assert argv[2] == ("prefill_node" if spec.name.startswith("prefill") else "decode_node")
        assert argv[argv.index("--coordinator") + 1] == "127.0.0.1:20000"
        assert argv[argv.index("--kv-backend") + 1] == "shm"
        assert argv[argv.index("--worker-id") + 1] == spec.name
        assert argv[argv.index("--model") + 1] == str(tmp_path / "m.gguf")
        assert argv[argv.index("--max-batched-tokens") + 1] == "256"
        worker_ports.add(argv[argv.index("--port") + 1])
        assert spec.log_path == tmp_path / "logs" / f"{spec.name}.log"
    assert worker_ports == {"0"}  # each binds a port the kernel picks and registers it
    assert specs[3].argv[-2:] == ["--role", "decode"]
    assert ready.url == "http://127.0.0.1:11434"
    assert ready.expected == {"prefill": 2, "decode": 1}


def test_plan_colocated_and_validation(tmp_path):
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True)
    specs, ready = plan(t, ports())
    assert [s.name for s in specs] == ["coordinator", "colocated-0"]
    assert specs[1].argv[-2:] == ["--role", "colocated"]
    assert ready.expected == {"colocated": 1}
    with pytest.raises(ValueError, match="kv_backend"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, kv_backend="carrier-pigeon")
    with pytest.raises(ValueError, match="decode worker"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, decode=0)


def test_cluster_starts_until_workers_are_live_and_stops_every_child(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    t = Topology(model=str(model_dir), model_path=model_dir, log_dir=tmp_path / "logs",
                 port=free_port(), prefill=1, decode=1)
    specs, ready = plan(t)
    # The real coordinator process; fake worker processes in place of the lead's workers.
    specs = [specs[0]] + [
        ProcessSpec(s.name, [sys.executable, "-m", "tests.helpers.fake_worker_process", *s.argv[3:]],
                    s.log_path) for s in specs[1:]]
    cluster = LocalCluster(specs, ready, start_timeout_s=60, grace_s=5,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    with cluster:
        cluster.start()
        with urllib.request.urlopen(f"{ready.url}/internal/workers", timeout=5) as r:
            report = json.loads(r.read())
        processes = [c.process for c in cluster.children]
    assert report["live"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert sorted(w["worker_id"] for w in report["workers"]) == ["decode-0", "prefill-0"]
    assert all(p.poll() is not None for p in processes)
    assert "registered" in (tmp_path / "logs" / "coordinator.log").read_text()


def test_api_key_reaches_the_coordinator_process_through_its_environment(tmp_path):
    """`tandem serve --api-key`: the coordinator process (real) requires the key, the
    launcher's readiness poll of /internal/workers needs none, and no argv holds the key."""
    import urllib.error

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    t = Topology(model=str(model_dir), model_path=model_dir, log_dir=tmp_path / "logs",
                 port=free_port(), colocated=True, api_key="sk-deploy")
    specs, ready = plan(t)
    specs = [specs[0]] + [
        ProcessSpec(s.name, [sys.executable, "-m", "tests.helpers.fake_worker_process", *s.argv[3:]],
                    s.log_path) for s in specs[1:]]
    cluster = LocalCluster(specs, ready, start_timeout_s=60, grace_s=5,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    with cluster:
        cluster.start()
        argv = cluster.children[0].process.args
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{ready.url}/api/tags", timeout=5)
        keyed = urllib.request.Request(f"{ready.url}/api/tags",
                                       headers={"Authorization": "Bearer sk-deploy"})
        with urllib.request.urlopen(keyed, timeout=5) as r:
            tags = json.loads(r.read())
    assert refused.value.code == 401
    assert "missing API key" in json.loads(refused.value.read())["error"]
    assert [m["name"] for m in tags["models"]] == [str(model_dir)]
    assert "sk-deploy" not in " ".join(argv)
    assert "sk-deploy" not in (tmp_path / "logs" / "coordinator.log").read_text()


def test_killed_worker_is_restarted_while_the_rest_serve_on(tmp_path):
    """The supervisor (LocalCluster.wait): kill -9 a worker while serving; it is started again,
    registers again, and the coordinator never stopped."""
    import os
    import signal
    import threading
    import time

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    t = Topology(model=str(model_dir), model_path=model_dir, log_dir=tmp_path / "logs",
                 port=free_port(), prefill=1, decode=1)
    specs, ready = plan(t)
    specs = [specs[0]] + [
        ProcessSpec(s.name, [sys.executable, "-m", "tests.helpers.fake_worker_process", *s.argv[3:]],
                    s.log_path) for s in specs[1:]]
    cluster = LocalCluster(specs, ready, start_timeout_s=60, grace_s=5, restart_backoff_s=(0.2,),
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    events: list[str] = []
    cluster.out = events.append
    result: list[str | None] = []
    with cluster:
        cluster.start()
        coordinator, decode = cluster.children[0].process, cluster.children[2].process
        assert cluster.children[2].spec.name == "decode-0"
        server = threading.Thread(target=lambda: result.append(cluster.wait(poll_s=0.1)))
        server.start()
        os.kill(decode.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        restarted = None
        while time.monotonic() < deadline:
            child = cluster.children[2].process
            if child.pid != decode.pid and child.poll() is None:
                with urllib.request.urlopen(f"{ready.url}/internal/workers", timeout=5) as r:
                    report = json.loads(r.read())
                if {w["worker_id"]: w["alive"] for w in report["workers"]}.get("decode-0"):
                    restarted = child
                    break
            time.sleep(0.1)
        assert restarted is not None, events
        assert coordinator.poll() is None and cluster.children[0].process is coordinator
        cluster.stop_requested.set()
        server.join(10)
    assert result == [None]  # a requested stop, not a failure
    assert any("decode-0 exited with code -9 while serving" in e for e in events)
    assert any(e.startswith("restarted decode-0") for e in events)


def test_worker_dying_at_every_start_is_given_up_on(tmp_path):
    sleeper = ProcessSpec("coordinator", [sys.executable, "-c", "import time; time.sleep(60)"],
                          tmp_path / "coordinator.log")
    crasher = ProcessSpec("decode-0", [sys.executable, "-c", "import sys; print('refused'); sys.exit(3)"],
                          tmp_path / "decode-0.log")
    from deploy.process_plan import Readiness

    cluster = LocalCluster([sleeper, crasher], Readiness("http://127.0.0.1:1", {"decode": 1}),
                           grace_s=5, restart_backoff_s=(0.05,), max_quick_failures=2, quick_s=30)
    starts: list[str] = []
    cluster.out = starts.append
    with cluster:
        cluster.spawn()
        failure = cluster.wait(poll_s=0.05)
        assert cluster.children[0].process.poll() is None  # still serving until stop()
    assert failure is not None and "exited within 30 s of starting 3 times in a row" in failure
    assert "refused" in failure
    assert sum(e.startswith("restarted decode-0") for e in starts) == 2


def test_child_dying_during_start_up_stops_the_rest_and_names_it(tmp_path):
    sleeper = ProcessSpec("coordinator", [sys.executable, "-c", "import time; time.sleep(60)"],
                          tmp_path / "coordinator.log")
    crasher = ProcessSpec("decode-0", [sys.executable, "-c",
                                       "import sys; print('cannot load model: boom'); sys.exit(3)"],
                          tmp_path / "decode-0.log")
    from deploy.process_plan import Readiness

    cluster = LocalCluster([sleeper, crasher], Readiness(f"http://127.0.0.1:{free_port()}",
                                                         {"decode": 1}),
                           start_timeout_s=30, grace_s=5)
    with pytest.raises(LaunchError) as info:
        cluster.start()
    message = str(info.value)
    assert "decode-0 exited with code 3 during start-up" in message
    assert "cannot load model: boom" in message
    assert [c.process.poll() for c in cluster.children] == [-15, 3]  # the sleeper was stopped


def test_tandem_serve_reports_bad_topologies_without_traceback(tmp_path):
    import subprocess

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TANDEM_HOME": str(tmp_path / "h")}

    def serve(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", "serve", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    zero = serve("--model", str(model_dir), "--decode", "0")
    assert zero.returncode == 1 and "Traceback" not in zero.stderr
    assert "at least one decode worker" in zero.stderr
    missing = serve("--model", str(tmp_path / "nothing-here"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "no model named" in missing.stderr
    backend = serve("--kv-backend", "carrier-pigeon")
    assert backend.returncode == 2 and "invalid choice" in backend.stderr


def parsed_worker(spec: ProcessSpec):
    """A worker's planned command line, parsed by that worker's own flag parser."""
    from worker.flags import worker_arg_parser

    module = spec.argv[2]
    roles = ("prefill",) if module == "prefill_node" else ("decode", "colocated")
    return worker_arg_parser(module, roles).parse_args(spec.argv[3:])


def test_plan_carries_each_engine_flag_to_the_roles_that_use_it(tmp_path):
    from coordinator.__main__ import build_parser as coordinator_parser

    t = Topology(model="m", model_path=tmp_path / "m.gguf", log_dir=tmp_path, prefill=1, decode=2,
                 chunk_size=128, prefill_quant="w8a8", decode_quant="int8", threads=2,
                 num_blocks=300, local_chunk_size=32, max_streams=7, local_prefill_max_stall_ms=250)
    specs, _ = plan(t, ports())
    coord = coordinator_parser().parse_args(specs[0].argv[3:])
    assert (coord.chunk_size, coord.local_chunk_size, coord.max_streams,
            coord.local_prefill_max_stall_ms) == (128, 32, 7, 250)
    for flag in ("--prefill-quant", "--decode-quant", "--threads", "--num-blocks"):
        assert flag not in specs[0].argv
    prefill, *decodes = specs[1:]
    # Each role gets only its own format: a prefill worker never sees --decode-quant, nor a
    # decode worker --prefill-quant (each packs one format, engine.config.role_formats).
    assert "--prefill-quant" in prefill.argv and "--decode-quant" not in prefill.argv
    args = parsed_worker(prefill)
    assert (args.role, args.prefill_quant, args.threads, args.num_blocks, args.max_batched_tokens) == (
        "prefill", "w8a8", 2, 300, 128)
    for spec in decodes:
        assert "--decode-quant" in spec.argv and "--prefill-quant" not in spec.argv
        args = parsed_worker(spec)
        assert (args.role, args.decode_quant, args.threads, args.num_blocks, args.max_batched_tokens) == (
            "decode", "int8", 2, 300, 128)

    colocated = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True,
                         prefill_quant="bf16", decode_quant="int4", threads=3, num_blocks=50)
    specs, _ = plan(colocated, ports())
    args = parsed_worker(specs[1])
    assert (args.role, args.prefill_quant, args.decode_quant, args.threads, args.num_blocks) == (
        "colocated", "bf16", "int4", 3, 50)
    assert specs[1].argv[-2:] == ["--role", "colocated"]


def test_plan_leaves_unset_flags_to_each_process(tmp_path):
    specs, _ = plan(Topology(model="m", model_path=tmp_path, log_dir=tmp_path), ports())
    for flag in ("--prefill-quant", "--decode-quant", "--threads", "--num-blocks",
                 "--local-chunk-size", "--max-streams"):
        assert all(flag not in s.argv for s in specs), flag
    with_extra = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, decode_quant="int8",
                          worker_args=("--decode-quant", "fp32"))
    specs, _ = plan(with_extra, ports())
    assert parsed_worker(specs[2]).decode_quant == "fp32"  # worker_args come last and win


@pytest.mark.parametrize("field,value,message", [
    ("decode_quant", "w8a8", "decode_quant must be one of fp32, bf16, int8, int4"),
    ("prefill_quant", "int4a8", "prefill_quant must be one of auto, fp32, bf16, w8a8, int4"),
    ("threads", 0, "threads must be >= 1"),
    ("num_blocks", 0, "num_blocks must be >= 1"),
    ("max_streams", 0, "max_streams must be >= 1"),
    ("local_chunk_size", 0, "local_chunk_size must be >= 1"),
    ("local_chunk_size", 1024, r"local_chunk_size \(1024\) cannot exceed chunk_size \(512\)"),
    ("local_prefill_max_stall_ms", -1, "local_prefill_max_stall_ms must be >= 0"),
    ("local_prefill_max_stall_ms", float("nan"), "local_prefill_max_stall_ms must be >= 0"),
])
def test_topology_refuses_bad_engine_flags(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, **{field: value})


def test_worker_processes_refuse_bad_engine_flags(capsys):
    from worker.config import WorkerConfig
    from worker.flags import worker_arg_parser

    base = ["--model", "m", "--port", "1"]
    parser = worker_arg_parser("decode_node", ("decode", "colocated"))
    for bad in (["--decode-quant", "w8a8"], ["--prefill-quant", "int4a8"]):  # argparse: choices
        with pytest.raises(SystemExit):
            parser.parse_args(base + bad)
    assert "invalid choice: 'w8a8'" in capsys.readouterr().err
    for bad, message in ((["--threads", "0"], "threads must be >= 1, got 0"),
                         (["--num-blocks", "0"], "num_blocks must be positive, got 0"),
                         (["--max-chunk-tokens", "-1"], "long_prefill_token_threshold must be >= 0, got -1"),
                         (["--max-batched-tokens", "0"], "max_num_batched_tokens must be positive")):
        with pytest.raises(ValueError, match=message):  # the config each worker builds once
            WorkerConfig.from_args(parser.parse_args(base + ["--device", "cpu"] + bad))


def test_tandem_serve_passes_its_flags_into_the_topology(tmp_path, monkeypatch):
    import cli.main
    import deploy.local

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}

    def fake_serve(topology, **kwargs):  # no process starts
        seen["t"] = topology
        return 0

    monkeypatch.setattr(deploy.local, "serve", fake_serve)
    assert cli.main.main(["serve", "--model", str(model_dir), "--prefill-quant", "bf16",
                            "--decode-quant", "int8", "--threads", "2", "--num-blocks", "64",
                            "--max-streams", "9", "--chunk-size", "256", "--local-chunk-size", "48",
                            "--local-prefill-max-stall-ms", "40",
                            "--log-dir", str(tmp_path / "logs")]) == 0
    t = seen["t"]
    assert (t.prefill_quant, t.decode_quant, t.threads, t.num_blocks, t.max_streams, t.chunk_size,
            t.local_chunk_size, t.local_prefill_max_stall_ms) == ("bf16", "int8", 2, 64, 9, 256, 48, 40)
    assert t.model_path == model_dir


def test_tandem_serve_refuses_bad_engine_flags_before_starting(tmp_path):
    import subprocess

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TANDEM_HOME": str(tmp_path / "h")}

    def serve(*args):
        # A model that does not exist: the flags are refused before it would be looked up.
        return subprocess.run([sys.executable, "-m", "cli.main", "serve", "--model",
                               str(tmp_path / "nothing-here"), "--log-dir", str(tmp_path / "logs"),
                               *args], env=env, capture_output=True, text=True, timeout=60)

    threads = serve("--threads", "0")
    assert threads.returncode == 1 and "Traceback" not in threads.stderr
    assert "threads must be >= 1, got 0" in threads.stderr
    local = serve("--local-chunk-size", "600")
    assert local.returncode == 1 and "cannot exceed chunk_size (512)" in local.stderr
    quant = serve("--decode-quant", "w8a8")
    assert quant.returncode == 2 and "invalid choice: 'w8a8'" in quant.stderr
    assert not (tmp_path / "logs").exists()  # nothing started


def test_plan_keeps_the_registry_port_off_the_ports_the_caller_names(tmp_path):
    # A caller's --grpc-port, picked free before the plan, is not free to the plan's picker.
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, port=11434,
                 coordinator_args=("--grpc-port", "20000"))
    specs, _ = plan(t, iter([11434, 20000, 20001]).__next__)
    coord = specs[0].argv
    assert coord[coord.index("--registry-port") + 1] == "20001"


def test_plan_gives_each_model_its_own_workers_and_one_coordinator_all_models(tmp_path):
    from coordinator.__main__ import build_parser as coordinator_parser

    t = Topology(model="smollm2", model_path=tmp_path / "a.gguf", log_dir=tmp_path, prefill=1,
                 decode=2, decode_quant="int8",
                 more_models=(("qwen3:0.6b", tmp_path / "b.gguf"), ("/models/Qwen3", tmp_path / "c")))
    specs, ready = plan(t, ports())
    coord = coordinator_parser().parse_args(specs[0].argv[3:])
    assert coord.model == ["smollm2", "qwen3:0.6b", "/models/Qwen3"]
    workers = {s.name: s for s in specs[1:]}
    # The first model's workers keep their single-model names; the others carry their model's.
    assert list(workers) == ["prefill-0", "decode-0", "decode-1",
                             "qwen3-0-6b-prefill-0", "qwen3-0-6b-decode-0", "qwen3-0-6b-decode-1",
                             "qwen3-prefill-0", "qwen3-decode-0", "qwen3-decode-1"]
    for name, path in (("decode-1", "a.gguf"), ("qwen3-0-6b-prefill-0", "b.gguf"),
                       ("qwen3-decode-0", "c")):
        args = parsed_worker(workers[name])
        assert (args.model, args.worker_id) == (str(tmp_path / path), name)
    assert parsed_worker(workers["qwen3-decode-1"]).decode_quant == "int8"
    assert ready.expected == {"prefill": 3, "decode": 6}
    assert ready.worker_ids == tuple(workers)  # ready only once each one, by name, is live

    colocated = Topology(model="a", model_path=tmp_path, log_dir=tmp_path, colocated=True,
                         more_models=(("b", tmp_path / "b"),))
    specs, ready = plan(colocated, ports())
    assert [s.name for s in specs[1:]] == ["colocated-0", "b-colocated-0"]
    assert ready.expected == {"colocated": 2}
    # A single-model topology is as it was: no names required beyond the counts.
    assert plan(Topology(model="a", model_path=tmp_path, log_dir=tmp_path), ports())[1].worker_ids == ()


def test_plan_refuses_a_model_twice_and_names_that_would_clash(tmp_path):
    with pytest.raises(ValueError, match="named twice"):
        Topology(model="a", model_path=tmp_path, log_dir=tmp_path, more_models=(("a", tmp_path),))
    # Two slugs alike get the model's position; the first model's names are its own.
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True,
                 more_models=(("b:1", tmp_path), ("b.1", tmp_path)))
    assert [s.name for s in plan(t, ports())[0][1:]] == [
        "colocated-0", "b-1-1-colocated-0", "b-1-2-colocated-0"]


def test_a_model_may_have_worker_counts_of_its_own(tmp_path):
    t = Topology(model="smollm2", model_path=tmp_path / "a.gguf", log_dir=tmp_path, prefill=1,
                 decode=1, more_models=(("qwen3:8b", tmp_path / "b.gguf"), ("c", tmp_path / "c")),
                 model_workers=(("qwen3:8b", 2, 3), ("c", 0, 1)))
    assert [t.counts(i) for i in range(3)] == [(1, 1), (2, 3), (0, 1)]
    specs, ready = plan(t, ports())
    assert [s.name for s in specs[1:]] == [
        "prefill-0", "decode-0", "qwen3-8b-prefill-0", "qwen3-8b-prefill-1",
        "qwen3-8b-decode-0", "qwen3-8b-decode-1", "qwen3-8b-decode-2", "c-decode-0"]
    assert {parsed_worker(s).model for s in specs[3:8]} == {str(tmp_path / "b.gguf")}
    assert ready.expected == {"prefill": 3, "decode": 5}
    assert ready.worker_ids == tuple(s.name for s in specs[1:])


@pytest.mark.parametrize("counts, colocated, message", [
    ((("gamma", 1, 1),), False, r"given for 'gamma', which is not a served model \(models: a, b\)"),
    ((("b", 1, 1), ("b", 2, 2)), False, "given twice for a model: b, b"),
    ((("b", 1, 0),), False, "at least one decode worker of 'b', got decode=0"),
    ((("b", 1, 1),), True, "a colocated topology has one colocated worker per model"),
])
def test_worker_counts_per_model_are_checked(tmp_path, counts, colocated, message):
    with pytest.raises(ValueError, match=message):
        Topology(model="a", model_path=tmp_path, log_dir=tmp_path, colocated=colocated,
                 more_models=(("b", tmp_path),), model_workers=counts)


def test_tandem_serve_takes_worker_counts_per_model(tmp_path, monkeypatch):
    import cli.main
    import deploy.local
    from cli.serve import model_workers
    from common.errors import TandemError

    one, two = make_tiny_model_dir(tmp_path / "one"), make_tiny_model_dir(tmp_path / "two")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.__setitem__("t", topology) or 0)
    assert cli.main.main(["serve", "--model", str(one), "--model", str(two), "--decode", "2",
                          "--workers", f"{two}=0:3", "--log-dir", str(tmp_path / "logs")]) == 0
    t = seen["t"]
    assert (t.counts(0), t.counts(1)) == ((1, 2), (0, 3))
    # With --load-on-request a name no --model serves is kept for the load of that model.
    assert cli.main.main(["serve", "--model", str(one), "--load-on-request", "--workers",
                          "qwen3:0.6b=2:1", "--log-dir", str(tmp_path / "logs")]) == 0
    assert seen["t"].counts_for("registry.ollama.ai/library/qwen3:0.6b") == (2, 1)
    assert cli.main.main(["serve", "--model", str(one), "--workers", "qwen3:0.6b=2:1",
                          "--log-dir", str(tmp_path / "logs")]) != 0  # not served, not on request
    assert model_workers(["/m=x/y=1:2"]) == (("/m=x/y", 1, 2),)
    for bad in ("qwen3=1", "qwen3=a:2", "=1:2", "qwen3=1:-2"):
        with pytest.raises(TandemError, match="expected MODEL=PREFILL:DECODE"):
            model_workers([bad])
