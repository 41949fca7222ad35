"""`tandem serve --kv-backend auto` (deploy/kv_backend_choice.py): shm where every decode
worker's KV pool fits /dev/shm and the workers compute on the CPU, else zmq with the reason;
and a shared-memory pool larger than /dev/shm's free space is refused with an error before
any page of it is touched (kvtransfer/layout.py), not left to kill the worker with SIGBUS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvtransfer as kt
from cli.main import build_parser
from common import shm_segments
from common.model_files import load_config
from deploy.kv_backend_choice import SHM_SLACK_BYTES, choose, pool_bytes
from deploy.local_topology import Topology
from engine.config import CacheConfig
from reliability.model_factory import make_tiny_hf_model

GIB = 1 << 30


def topology(path: Path, **kw) -> Topology:
    return Topology(model="m", model_path=path, log_dir=path.parent / "logs", **kw)


def test_serve_defaults_to_auto_and_workers_keep_zmq():
    assert build_parser().parse_args(["serve"]).kv_backend == "auto"
    assert build_parser().parse_args(["serve", "--kv-backend", "zmq"]).kv_backend == "zmq"
    from worker.flags import worker_arg_parser

    argv = ["--model", "m", "--port", "0", "--coordinator", "127.0.0.1:1"]
    assert worker_arg_parser("decode_node", ("decode",)).parse_args(argv).kv_backend == "zmq"
    with pytest.raises(SystemExit):  # auto is the launcher's word, not a worker's
        worker_arg_parser("decode_node", ("decode",)).parse_args([*argv, "--kv-backend", "auto"])


def test_shm_where_every_pool_fits_else_zmq_with_the_reason(tmp_path):
    t = topology(tmp_path / "m", decode=2)  # pools sized by the 1 GiB budget: no model read
    need = SHM_SLACK_BYTES + 2 * CacheConfig().kv_cache_bytes
    assert choose(t, "cpu", shm_free=need)[0] == "shm"
    backend, why = choose(t, "cpu", shm_free=need - 1)
    assert backend == "zmq" and "/dev/shm has" in why and f"{need / 2**20:,.0f} MiB" in why
    assert choose(t, "cpu", shm_free=None)[0] in ("shm", "zmq")  # read from this host
    assert choose(t, "cuda", shm_free=100 * GIB) == (
        "zmq", "the workers compute on cuda, and shm needs a KV cache in host memory")
    assert choose(topology(tmp_path / "m", colocated=True), "cpu", shm_free=100 * GIB)[0] == "zmq"


def test_a_given_pool_size_is_counted_in_the_models_blocks(tmp_path):
    path = make_tiny_hf_model(tmp_path / "tiny")
    model = load_config(path)
    per_block = model.num_layers * 2 * 16 * model.num_kv_heads * model.head_dim * 4  # fp32
    assert pool_bytes(path, 100, "fp32") == 100 * per_block
    assert pool_bytes(path, 100, "bf16") == 50 * per_block
    t = topology(path, decode=3, num_blocks=100)
    assert choose(t, "cpu", shm_free=SHM_SLACK_BYTES + 3 * 100 * per_block)[0] == "shm"
    assert choose(t, "cpu", shm_free=SHM_SLACK_BYTES + 3 * 100 * per_block - 1)[0] == "zmq"


def test_a_pool_larger_than_dev_shm_is_refused_before_it_is_made(monkeypatch):
    layout = kt.KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32",
                         model_id="tiny")
    name = f"tandem-kv-test-{os.getpid()}"
    monkeypatch.setattr(shm_segments, "free_bytes", lambda directory=shm_segments.SHM_DIR: 4096)
    with pytest.raises(kt.KVTransferError, match="/dev/shm has 0 MiB free.*--kv-backend zmq"):
        kt.allocate_cache(layout, 64, shared_memory_name=name)  # 16 KiB
    assert not os.path.exists(os.path.join(shm_segments.SHM_DIR, name))
    cache = kt.allocate_cache(layout, 8, shared_memory_name=name)  # 2 KiB fits
    try:
        assert cache.tensor.shape[2] == 8
    finally:
        cache.close()
