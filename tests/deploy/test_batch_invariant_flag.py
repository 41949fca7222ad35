"""--batch-invariant from `tandem serve` to every worker, and from a worker's command line to
its kernels (kernels/batch_invariance.py), switched on by configure_process."""

from __future__ import annotations

import pytest

from deploy.process_plan import plan
from kernels import batch_invariance
from tests.helpers.coordinator_fakes import make_tiny_model_dir
from worker.config import WorkerConfig
from worker.flags import worker_arg_parser
from worker.runtime import configure_process


@pytest.fixture
def mode_restored():
    previous = batch_invariance.set_enabled(False)
    yield
    batch_invariance.set_enabled(previous)


def served_workers(tmp_path, monkeypatch, *flags: str) -> list[WorkerConfig]:
    import cli.main
    import deploy.local

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.setdefault("t", topology) and 0)
    assert cli.main.main(["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs"),
                          *flags]) == 0
    ports = iter(range(23100, 23200))
    specs, _ = plan(seen["t"], lambda: next(ports))
    configs = []
    for spec in specs[1:]:
        module = spec.argv[2]
        roles = ("prefill",) if module == "prefill_node" else ("decode", "colocated")
        configs.append(WorkerConfig.from_args(worker_arg_parser(module, roles).parse_args(spec.argv[3:])))
    return configs


def test_tandem_serve_gives_every_worker_the_mode(tmp_path, monkeypatch):
    workers = served_workers(tmp_path, monkeypatch, "--batch-invariant")
    assert sorted(w.role for w in workers) == ["decode", "prefill"]
    assert all(w.batch_invariant for w in workers)
    assert not any(w.batch_invariant for w in served_workers(tmp_path / "off", monkeypatch))


def test_configure_process_switches_the_kernels(mode_restored):
    configure_process(1)
    assert not batch_invariance.enabled()  # off unless asked
    configure_process(1, batch_invariant=True)
    assert batch_invariance.enabled()


def test_every_prompt_goes_to_a_prefill_worker(tmp_path):
    """A short uncached part (a prefix-cache hit) would otherwise prefill on the decode worker,
    in the decode format, so the same prompt's rows would change format with the cache."""
    from deploy.local_topology import Topology

    def threshold(**kw):
        flags = Topology(model="m", model_path=tmp_path, log_dir=tmp_path, **kw).coordinator_flags()
        return flags[flags.index("--prefill-threshold") + 1] if "--prefill-threshold" in flags else None

    assert threshold() is None  # the coordinator's own default
    assert threshold(batch_invariant=True) == "0"
    assert threshold(batch_invariant=True, prefill_threshold=0) == "0"
    with pytest.raises(ValueError, match="prefill_threshold 64 prefills short prompts"):
        Topology(model="m", model_path=tmp_path, log_dir=tmp_path, batch_invariant=True,
                 prefill_threshold=64)
