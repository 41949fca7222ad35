"""The KV cache dtype option (fp32 | bf16) end to end, short of real worker processes: the
engine config, the worker, `tandem serve` and `tandem run` flags, the serve plan, and the
coordinator refusing a worker whose KV dtype cannot pair. Transfers: test_kvtransfer_*.py;
disaggregated generation: test_disagg_workers.py and test_disaggregation.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deploy.process_plan import plan
from deploy.local_topology import Topology
from engine.config import CacheConfig, EngineConfig, KV_DTYPES
from engine.kv_cache_sizing import kv_dtype_name
from engine.llm_engine import LLMEngine
from worker.config import WorkerConfig
from worker.flags import worker_arg_parser
from worker.node_server import kv_layout
from reliability.model_factory import make_tiny_hf_model

BASE = ["--model", "m", "--port", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


def ports():
    n = iter(range(21000, 21100))
    return lambda: next(n)


def parsed_worker(argv: list[str]):
    """A worker's planned command line, parsed by that worker's own flag parser."""
    module = argv[2]
    roles = ("prefill",) if module == "prefill_node" else ("decode", "colocated")
    return worker_arg_parser(module, roles).parse_args(argv[3:])


# -- engine --------------------------------------------------------------------------------------


def test_cache_config_and_engine_validate_the_kv_dtype(tmp_path):
    assert KV_DTYPES == ("fp32", "bf16") and CacheConfig().kv_dtype == "fp32"
    with pytest.raises(ValueError, match="CacheConfig.kv_dtype must be one of fp32, bf16, got 'fp16'"):
        CacheConfig(kv_dtype="fp16")
    assert kv_dtype_name(torch.bfloat16) == "bf16" and kv_dtype_name("fp32") == "fp32"
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, bf16"):
        kv_dtype_name(torch.float16)
    # Refused before the model is looked at (this path does not exist).
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, bf16, got 'int8'"):
        LLMEngine.from_path(tmp_path / "nothing-here", EngineConfig(
            cache=CacheConfig(kv_dtype="int8")))


def test_engine_allocates_its_cache_in_the_kv_dtype(model_dir):
    bf16 = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(num_blocks=8, kv_dtype="bf16")), load_tokenizer=False)
    assert bf16.config.cache.kv_dtype == "bf16" and bf16.runner.kv_cache.dtype == torch.bfloat16
    # The pool size from a byte budget counts 2-byte elements: twice the blocks of fp32.
    budget = 1 << 20
    n32 = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(kv_cache_bytes=budget)), load_tokenizer=False).config.cache.num_blocks
    n16 = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(kv_cache_bytes=budget, kv_dtype="bf16")), load_tokenizer=False).config.cache.num_blocks
    assert n16 == 2 * n32
    # A caller-provided cache (a decode worker's receive buffer) must be in the engine's dtype.
    shape = tuple(bf16.runner.kv_cache.shape)
    with pytest.raises(ValueError, match="kv_cache holds torch.float32, but the engine's KV dtype is bf16"):
        LLMEngine.from_path(model_dir, EngineConfig(
            cache=CacheConfig(num_blocks=8, kv_dtype="bf16")), kv_cache=torch.zeros(shape),
            load_tokenizer=False)
    with pytest.raises(ValueError, match="contradicts the engine config's cache.kv_dtype 'fp32'"):
        LLMEngine(bf16.model, EngineConfig(model=bf16.config.model), kv_dtype="bf16")


def test_worker_layout_carries_the_kv_dtype(model_dir):
    engine = LLMEngine.from_path(model_dir, EngineConfig(
        cache=CacheConfig(num_blocks=8, kv_dtype="bf16")), load_tokenizer=False)
    config = engine.config.model
    layout = kv_layout(config, 16, kv_dtype_name(engine.runner.kv_cache.dtype), "model-x")
    fp32 = kv_layout(config, 16, "fp32", "model-x")
    assert layout.dtype == "bfloat16" and layout.torch_dtype == engine.runner.kv_cache.dtype
    assert layout.fingerprint != fp32.fingerprint and layout.diff(fp32) == ["dtype: 'bfloat16' != 'float32'"]
    assert 2 * layout.bytes_per_block_per_layer() == fp32.bytes_per_block_per_layer()
    # One layer's slice of the engine's cache is exactly what the layout says travels.
    assert engine.runner.kv_cache[0, :, [1, 2]].shape == layout.payload_shape(2)


# -- worker flags ----------------------------------------------------------------------------------


def test_worker_kv_dtype_flag_defaults_validates_and_reaches_the_engine(capsys):
    for module, roles in (("prefill_node", ("prefill",)), ("decode_node", ("decode", "colocated"))):
        parser = worker_arg_parser(module, roles)
        assert parser.parse_args(BASE).kv_dtype == "fp32"
        assert parser.parse_args(BASE + ["--kv-dtype", "bf16"]).kv_dtype == "bf16"
        with pytest.raises(SystemExit):
            parser.parse_args(BASE + ["--kv-dtype", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_build_engine_uses_the_worker_kv_dtype(model_dir, monkeypatch):
    from worker import node_server

    seen = {}

    def fake_from_path(path, config, **kwargs):
        seen["config"] = config
        raise RuntimeError("stop here")

    monkeypatch.setattr(node_server.LLMEngine, "from_path", staticmethod(fake_from_path))
    monkeypatch.setattr(node_server, "configure_process", lambda threads, **kw: None)
    args = worker_arg_parser("prefill_node", ("prefill",)).parse_args(BASE + ["--kv-dtype", "bf16"])
    with pytest.raises(RuntimeError, match="stop here"):
        node_server.build_engine(WorkerConfig.from_args(args), model_dir)
    assert seen["config"].cache.kv_dtype == "bf16"


# -- tandem serve: topology, plan, CLI ------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_plan_gives_every_worker_the_one_kv_dtype(tmp_path, kv_dtype):
    t = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, prefill=2, decode=2,
                 kv_dtype=kv_dtype)
    specs, _ = plan(t, ports())
    assert "--kv-dtype" not in specs[0].argv  # the coordinator holds no KV
    assert [s.name for s in specs[1:]] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    for spec in specs[1:]:
        assert spec.argv.count("--kv-dtype") == 1
        assert parsed_worker(spec.argv).kv_dtype == kv_dtype
    colocated = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True,
                         kv_dtype=kv_dtype)
    specs, _ = plan(colocated, ports())
    assert parsed_worker(specs[1].argv).kv_dtype == kv_dtype


def test_topology_refuses_a_bad_kv_dtype(tmp_path):
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, bf16, got 'fp16'"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, kv_dtype="fp16")


def test_tandem_serve_passes_kv_dtype_into_the_topology(tmp_path, monkeypatch, capsys):
    import cli.main
    import deploy.local
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = []
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.append(topology) or 0)
    common = ["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs")]
    assert cli.main.main(common + ["--kv-dtype", "bf16"]) == 0
    assert cli.main.main(common) == 0
    assert [t.kv_dtype for t in seen] == ["bf16", "fp32"]
    with pytest.raises(SystemExit) as exc:
        cli.main.main(common + ["--kv-dtype", "fp16"])
    assert exc.value.code == 2 and "invalid choice: 'fp16'" in capsys.readouterr().err
    assert len(seen) == 2


def test_tandem_run_builds_its_engine_with_the_kv_dtype(model_dir, tmp_path, monkeypatch):
    import cli.main
    import engine.llm_engine

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}

    def fake_from_path(path, config, **kwargs):
        seen["config"] = config
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine.llm_engine.LLMEngine, "from_path", staticmethod(fake_from_path))
    monkeypatch.setattr("worker.runtime.configure_process", lambda threads, **kw: None)
    for argv, want in ((["--kv-dtype", "bf16"], "bf16"), ([], "fp32")):
        with pytest.raises(RuntimeError, match="stop here"):
            cli.main.main(["run", str(model_dir), "hi", "--local", *argv])
        assert seen.pop("config").cache.kv_dtype == want


# -- the coordinator refuses a worker whose KV dtype differs ---------------------------------------


def test_registry_refuses_a_worker_whose_kv_dtype_differs(model_dir):
    from coordinator.config import CoordinatorConfig
    from coordinator.registry import WorkerRegistry
    from common.model_files import load_config
    from common.rpc import worker_pb2 as pb

    config = load_config(model_dir)
    fp32, bf16 = (kv_layout(config, 16, d, "model-x").description for d in ("fp32", "bf16"))

    async def scenario():  # accepted workers get grpc.aio channels: they need a running loop
        registry = WorkerRegistry(CoordinatorConfig(), "fp")

        def info(worker_id, role, layout):
            return pb.WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{len(worker_id)}",
                                 model_fingerprint="fp", kv_backend="zmq", kv_layout_fingerprint=layout)
        return (registry.register(info("p0", "prefill", bf16)),
                registry.register(info("d0", "decode", fp32)),
                registry.register(info("d1", "decode", bf16)))

    first, other, same = asyncio.run(scenario())
    assert first.accepted and same.accepted
    assert not other.accepted
    assert f"KV layout fingerprint {fp32!r}" in other.reason and bf16 in other.reason
    assert "'float32 L2" in other.reason and "(bfloat16 L2" in other.reason
