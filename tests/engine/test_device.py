"""engine/device.py: --device is resolved once, at start-up, with clear errors."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.device import resolve_device
from common.hf_config import hf_model_config
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from reliability.model_factory import build_tiny_hf


def test_cpu_and_auto():
    assert resolve_device("cpu").torch_device == torch.device("cpu")
    assert resolve_device(" CPU ").spec == "cpu"
    auto = resolve_device("auto")
    assert auto.torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None).torch_device == auto.torch_device


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "cpu:0", "auto:1", "", "mps"])
def test_bad_specs_name_the_choices(spec):
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, cuda:N"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_without_cuda_fails_at_start_up(spec, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no usable CUDA device"):
        resolve_device(spec)
    assert resolve_device("auto").torch_device == torch.device("cpu")


def test_cuda_index_past_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1").torch_device == torch.device("cuda", 1)


def test_engine_from_path_checks_the_device_before_loading(tmp_path, monkeypatch):
    from engine.llm_engine import LLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no usable CUDA device"):
        # Fails before the load: the path does not exist.
        LLMEngine.from_path(tmp_path / "no-such-model", EngineConfig(device="cuda"))


def test_model_and_runner_follow_the_device():
    hf = build_tiny_hf("llama", vocab_size=96, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    config = hf_model_config(hf.config.to_dict())
    model = model_class("llama")(config, dict(hf.state_dict()), "fp32", device="cpu")
    assert model.device == torch.device("cpu") and model.cos.device.type == "cpu"
    runner = ModelRunner(model, CacheConfig(block_size=4, num_blocks=4))
    logits = runner.execute([SequenceChunk([1, 2, 3], 0, [1], True)])
    assert logits.dtype == torch.float32 and logits.device == runner.kv_cache.device
    with pytest.raises(ValueError, match="kv_cache is on meta"):
        ModelRunner(model, CacheConfig(block_size=4, num_blocks=4),
                    kv_cache=torch.zeros(runner.kv_cache.shape, device="meta"))


# -- the flag, from the command lines to the engine -------------------------------------------------


def test_every_planned_worker_gets_the_device(tmp_path):
    from deploy.process_plan import plan
    from deploy.local_topology import Topology
    from worker.flags import worker_arg_parser

    n = iter(range(22000, 22100))
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, prefill=1, decode=2,
                 device="cuda:1", cuda_graphs=False)
    specs, _ = plan(t, lambda: next(n))
    assert "--device" not in specs[0].argv  # the coordinator runs no model
    for spec in specs[1:]:
        module = spec.argv[2]
        roles = ("prefill",) if module == "prefill_node" else ("decode", "colocated")
        args = worker_arg_parser(module, roles).parse_args(spec.argv[3:])
        assert (args.device, args.no_cuda_graphs) == ("cuda:1", True)
    default = Topology(model="m", model_path=tmp_path, log_dir=tmp_path)
    assert default.worker_flags("decode")[-2:] == ["--device", "auto"]
    with pytest.raises(ValueError, match="device must be one of"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, device="gpu0")


def test_worker_builds_its_engine_on_the_device(tmp_path, monkeypatch):
    from worker import node_server
    from worker.config import WorkerConfig
    from worker.flags import worker_arg_parser

    seen = {}

    def fake_from_path(path, config, **kwargs):
        seen["config"] = config
        raise RuntimeError("stop here")

    monkeypatch.setattr(node_server.LLMEngine, "from_path", staticmethod(fake_from_path))
    monkeypatch.setattr(node_server, "configure_process", lambda threads, **kw: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = worker_arg_parser("decode_node", ("decode",))
    # --device auto is resolved once, when the worker builds its config.
    for argv, want in (([], ("cpu", True)), (["--device", "cpu", "--no-cuda-graphs"], ("cpu", False))):
        config = WorkerConfig.from_args(parser.parse_args(["--model", "m", "--port", "1", *argv]))
        with pytest.raises(RuntimeError, match="stop here"):
            node_server.build_engine(config, tmp_path)
        assert (seen["config"].device, seen["config"].cuda_graphs) == want


def test_worker_without_cuda_exits_at_start_up(monkeypatch, capsys):
    from worker import node_server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    code = node_server.node_main("decode_node", ("decode",), lambda args: started.append(args),
                                 ["--model", "m", "--port", "1", "--device", "cuda"])
    assert code == 1 and not started
    assert "no usable CUDA device" in capsys.readouterr().err


def test_tandem_serve_and_run_pass_the_device(tmp_path, monkeypatch, capsys):
    import cli.main
    import deploy.local
    import engine.llm_engine
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    topologies = []
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: topologies.append(topology) or 0)
    common = ["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs")]
    assert cli.main.main(common + ["--device", "cpu", "--no-cuda-graphs"]) == 0
    assert cli.main.main(common) == 0
    assert [(t.device, t.cuda_graphs) for t in topologies] == [("cpu", False), ("auto", True)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main.main(common + ["--device", "cuda"]) == 1  # before anything starts
    assert "no usable CUDA device" in capsys.readouterr().err and len(topologies) == 2

    seen = {}

    def fake_from_path(path, config, **kwargs):
        seen["config"] = config
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine.llm_engine.LLMEngine, "from_path", staticmethod(fake_from_path))
    monkeypatch.setattr("worker.runtime.configure_process", lambda threads, **kw: None)
    with pytest.raises(RuntimeError, match="stop here"):
        cli.main.main(["run", str(model_dir), "hi", "--local", "--device", "cpu"])
    assert (seen["config"].device, seen["config"].cuda_graphs) == ("cpu", True)
