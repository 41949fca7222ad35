"""--speculative from `tandem serve` to the workers: decode and colocated workers get it,
prefill workers never do; each process checks it once."""

from __future__ import annotations

import pytest

from deploy.process_plan import plan
from deploy.local_topology import Topology
from engine.speculative_config import SpeculativeConfig
from tests.helpers.coordinator_fakes import make_tiny_model_dir
from worker.config import WorkerConfig
from worker.flags import worker_arg_parser


def test_tandem_serve_passes_speculative_to_decode_workers_only(tmp_path, monkeypatch):
    import cli.main
    import deploy.local

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.setdefault("t", topology) and 0)
    assert cli.main.main(["serve", "--model", str(model_dir), "--speculative", "ngram:k=3",
                          "--log-dir", str(tmp_path / "logs")]) == 0
    t = seen["t"]
    assert t.speculative == "ngram:k=3"
    ports = iter(range(23000, 23100))
    specs, _ = plan(t, lambda: next(ports))
    modules = {}
    for spec in specs[1:]:
        module = spec.argv[2]
        roles = ("prefill",) if module == "prefill_node" else ("decode", "colocated")
        args = worker_arg_parser(module, roles).parse_args(spec.argv[3:])
        config = WorkerConfig.from_args(args)
        modules[module] = (args.speculative, config.engine.speculative)
    assert modules == {"prefill_node": (None, None),
                       "decode_node": ("ngram:k=3", SpeculativeConfig(num_speculative_tokens=3))}
    colocated = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, colocated=True,
                         speculative="ngram:k=2,n=2..4")
    assert "--speculative" in colocated.worker_flags("colocated")
    assert "--speculative" not in Topology(model="m", model_path=tmp_path,
                                           log_dir=tmp_path).worker_flags("decode")  # off by default


def test_bad_speculative_specs_are_refused_by_every_process(tmp_path):
    with pytest.raises(ValueError, match="--speculative 'ngram:k=0'"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, speculative="ngram:k=0")
    base = ["--model", "m", "--port", "1", "--device", "cpu"]
    for module, roles in (("decode_node", ("decode", "colocated")), ("prefill_node", ("prefill",))):
        args = worker_arg_parser(module, roles).parse_args(base + ["--speculative", "eagle:k=2"])
        with pytest.raises(ValueError, match="method must be one of ngram"):
            WorkerConfig.from_args(args)


def test_tandem_run_refuses_a_bad_spec(capsys, monkeypatch):
    import cli.main

    monkeypatch.setenv("OLLAMA_HOST", "127.0.0.1:1")  # no server there: the in-process engine

    assert cli.main.main(["run", "smollm2", "hi", "--speculative", "ngram"]) != 0
    assert "k=N is required" in capsys.readouterr().err


def test_a_draft_spec_reaches_the_decode_engine_and_not_the_prefill_one(tmp_path):
    topology = Topology(model="m", model_path=tmp_path, log_dir=tmp_path,
                        speculative="draft:smollm2,k=3")
    assert "draft:smollm2,k=3" in topology.worker_flags("decode")
    assert "--speculative" not in topology.worker_flags("prefill")
    base = ["--model", "m", "--port", "1", "--device", "cpu", "--speculative", "draft:smollm2,k=3"]
    decode = WorkerConfig.from_args(worker_arg_parser("decode_node", ("decode", "colocated"))
                                    .parse_args(base))
    assert decode.engine.speculative == SpeculativeConfig(method="draft", num_speculative_tokens=3,
                                                          draft_model="smollm2")
    prefill = WorkerConfig.from_args(worker_arg_parser("prefill_node", ("prefill",)).parse_args(base))
    assert prefill.engine.speculative is None  # the prefill worker never loads the draft
    with pytest.raises(ValueError, match="draft needs its model first"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, speculative="draft:k=3")
