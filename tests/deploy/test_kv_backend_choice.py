"""`tandem serve --kv-backend auto` (deploy/kv_backend_choice.py): shm where every decode
worker's KV pool fits /dev/shm and the workers compute on the CPU, else zmq with the reason;
and a shared-memory segment larger than /dev/shm's free space is refused with an error when
it is made (kvtransfer/layout.py create_segment: its pages reserved at once), not left to
kill the worker with SIGBUS at its first write past the free space: checked in a private
mount namespace whose /dev/shm is a 4 MiB tmpfs, two processes asking for it at once."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
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
    assert choose(t, "cpu", shm_free=need) == (
        "shm", "every worker is on this host and the decode workers' KV pools (2,048 MiB) fit "
               f"/dev/shm ({need // 2**20:,} MiB free)")
    backend, why = choose(t, "cpu", shm_free=need - 1)
    assert backend == "zmq" and why.startswith(
        "/dev/shm has 2,111 MiB free, the decode workers' KV pools need 2,048 MiB and 64 MiB")
    assert choose(t, "cpu", shm_free=None)[0] in ("shm", "zmq")  # read from this host
    assert choose(t, "cuda", shm_free=100 * GIB) == (
        "zmq", "the workers compute on cuda, and shm needs a KV cache in host memory")
    assert choose(topology(tmp_path / "m", colocated=True), "cpu", shm_free=100 * GIB)[0] == "zmq"
    # A model loaded on request starts workers later: room for them cannot be counted now.
    later = topology(tmp_path / "m", load_on_request=True)
    assert choose(later, "cpu", shm_free=100 * GIB)[0] == "zmq"


def test_a_given_pool_size_is_counted_in_the_models_blocks(tmp_path):
    path = make_tiny_hf_model(tmp_path / "tiny")
    model = load_config(path)
    per_block = model.num_layers * 2 * 16 * model.num_kv_heads * model.head_dim * 4  # fp32
    assert pool_bytes(path, 100, "fp32") == 100 * per_block
    assert pool_bytes(path, 100, "bf16") == 50 * per_block
    t = topology(path, decode=3, num_blocks=100)
    assert choose(t, "cpu", shm_free=SHM_SLACK_BYTES + 3 * 100 * per_block)[0] == "shm"
    assert choose(t, "cpu", shm_free=SHM_SLACK_BYTES + 3 * 100 * per_block - 1)[0] == "zmq"


def test_a_segment_without_room_is_an_error_and_leaves_nothing(monkeypatch):
    layout = kt.KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32",
                         model_id="tiny")
    name = f"tandem-kv-test-{os.getpid()}"

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(kt.KVTransferError, match="KV pool needs 1 MiB.*--kv-backend zmq"):
        kt.allocate_cache(layout, 64, shared_memory_name=name)  # 16 KiB, rounded up
    assert not os.path.exists(os.path.join(shm_segments.SHM_DIR, name))
    monkeypatch.undo()
    cache = kt.allocate_cache(layout, 8, shared_memory_name=name)
    try:
        assert cache.tensor.shape[2] == 8
    finally:
        cache.close()


# Two processes, each asking for 3 MiB of a 4 MiB /dev/shm at once: each would pass a check
# of the free space made before, and one of them died of SIGBUS. With the pages reserved when
# the segment is made, neither dies: at most one gets its pool, and each other gets the error
# (two reservations running at the same moment can each fail partway, so both may: a loaded
# CI host did that).
_RACE = """
import multiprocessing as mp, sys
sys.path.insert(0, {root!r})

def one(i, out):
    import kvtransfer as kt
    layout = kt.KVLayout(num_layers=1, num_kv_heads=1, head_dim=1024, block_size=16,
                         dtype="float32", model_id="tiny")  # 128 KiB a block
    try:
        cache = kt.allocate_cache(layout, 24, shared_memory_name=f"tandem-kv-race-{{i}}")
        out.put("pool")
        mp.Event().wait(2.0)  # hold it while the other tries
        cache.close()
    except kt.KVTransferError as e:
        out.put(str(e))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=one, args=(i, out)) for i in range(2)]
    for p in procs: p.start()
    for p in procs: p.join(120)
    print([p.exitcode for p in procs])
    print(sorted(out.get(timeout=5) for _ in procs))
"""


def test_two_pools_racing_for_a_small_dev_shm_get_errors_not_sigbus(tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"a private mount namespace with its own /dev/shm needs root; uid is {os.geteuid()}")
    script = tmp_path / "race.py"
    script.write_text(_RACE.format(root=str(Path(__file__).resolve().parents[2])))
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {sys.executable} {script}"],
        capture_output=True, text=True, timeout=300)
    if done.returncode and "mount" in done.stderr and "permission" in done.stderr.lower():
        pytest.skip(f"this sandbox refuses a private mount namespace: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr
    codes, outcomes = done.stdout.strip().splitlines()
    assert codes == "[0, 0]", done.stdout + done.stderr  # neither died of SIGBUS (-7)
    got = eval(outcomes)  # noqa: S307 (our own script's repr of two strings)
    assert got.count("pool") <= 1, got
    for error in (g for g in got if g != "pool"):
        assert error.startswith("the shared-memory KV pool needs 3 MiB and /dev/shm has "), got
