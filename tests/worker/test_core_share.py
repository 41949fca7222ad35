"""A worker's side of the core lease (worker/core_share.py), in its engine loop and across
processes: a prefill worker is busy for exactly the steps that compute; a decode worker's
native pool runs on the lent cores while the prefill worker is idle, drops to its own share
from the first step after the prefill worker turns busy, and gets them back when it is idle
again or dies; its calls never use more threads than the lease allows and give the same
results whatever it allows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from common.core_lease import CoreLease, Slot, lease_path
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from kernels import native, quant_int4
from reliability.model_factory import make_tiny_hf_model
from worker.core_share import CoreShare
from worker.engine_loop import EngineLoop

ROOT = Path(__file__).resolve().parents[2]
SLOTS = [Slot("prefill", 1), Slot("decode", 1)]


@pytest.fixture
def lease(tmp_path):
    lease = CoreLease.create(lease_path("t", directory=str(tmp_path)), SLOTS, cores=2)
    yield lease
    lease.unlink()


@pytest.fixture
def serial_afterwards():
    yield
    native.set_active(0)
    native.set_threads(1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return LLMEngine.from_path(make_tiny_hf_model(tmp_path_factory.mktemp("m") / "m", "llama"),
                               EngineConfig(cache=CacheConfig(num_blocks=64)))


def run_loop(engine: LLMEngine, cores: CoreShare, requests: int, on_step, tokens: int = 6) -> None:
    """`requests` greedy requests of `tokens` tokens through an EngineLoop with `cores`; on_step()
    runs inside every engine step, before the pass."""
    step = engine.step

    def recording_step():
        on_step()
        return step()

    engine.step = recording_step
    try:
        async def scenario():
            loop = EngineLoop(engine, asyncio.get_running_loop())
            loop.cores = cores
            done = asyncio.Event()
            left = [requests]

            def on_outputs(outputs):
                for out in outputs:
                    if out.finished:
                        left[0] -= 1
                if left[0] == 0:
                    loop.post(done.set)

            loop.on_outputs = on_outputs
            for i in range(requests):
                loop.call(lambda i=i: engine.add_request([1, 5 + i, 9, 13],
                                                         SamplingParams(temperature=0.0, num_predict=tokens)))
            loop.start()
            try:
                await asyncio.wait_for(done.wait(), 60)
                await asyncio.sleep(0.05)  # the loop's next idle iteration
            finally:
                loop.stop()

        asyncio.run(scenario())
    finally:
        engine.step = step


def test_a_prefill_worker_is_busy_during_its_steps_and_idle_after(engine, lease):
    share = CoreShare(lease, 0, "prefill", threads=1)
    seen = []
    run_loop(engine, share, 2, lambda: seen.append(lease.busy(0)))
    assert seen and all(seen), "a step ran while the lease said the prefill worker was idle"
    assert not lease.busy(0) and lease.threads_now(1) == 2  # nothing left: cores lent again
    share.close()


def test_a_decode_worker_gives_back_lent_cores_from_the_next_step(engine, lease, serial_afterwards):
    share = CoreShare(lease, 1, "decode", threads=1)
    share.size_pool()
    assert native.threads() == 2 and native.active() == 1  # made once, own share to start
    lease.claim(0, "prefill")
    lease.set_busy(0, False)  # loaded and idle
    active = []

    def on_step():
        active.append(native.active())
        if len(active) == 3:  # a prefill arrives while decode steps go on
            lease.set_busy(0, True)
        if len(active) == 6:
            lease.set_busy(0, False)

    run_loop(engine, share, 1, on_step, tokens=12)
    assert len(active) == 12  # one prefill step, 11 decode steps
    assert active[:3] == [2, 2, 2]   # prefill idle: both cores
    assert active[3:6] == [1, 1, 1]  # busy: from the very next step, its own share only
    assert set(active[6:]) == {2}    # idle again: lent again
    assert native.threads() == 2     # no thread started or stopped on the way
    share.close()


def test_kernels_are_timed_with_every_core_the_pool_may_borrow(engine, lease, serial_afterwards):
    """CoreShare.timing_guard (kernels/layout_choice.py's timing): it waits while the prefill
    worker loads (its slot busy), then lets the pool use all its threads for the measurement,
    whose key names them, and gives the pool its own share back after."""
    import threading
    import time

    share = CoreShare(lease, 1, "decode", threads=1)
    share.size_pool()
    lease.claim(0, "prefill")  # loading
    inside = []

    def timed():
        with share.timing_guard():
            inside.append((time.monotonic(), native.active()))

    t = threading.Thread(target=timed)
    t.start()
    time.sleep(0.3)
    assert not inside  # still waiting for the prefill worker's core
    freed = time.monotonic()
    lease.set_busy(0, False)
    t.join(10)
    assert inside and inside[0][0] >= freed and inside[0][1] == 2
    assert native.active() == 1
    with CoreShare(lease, 0, "prefill", threads=1).timing_guard():  # a prefill worker: nothing
        pass
    share.close()


# The prefill worker's side, in its own process: its slot, busy or idle on command.
PREFILL = """
    import sys
    from worker.core_share import CoreShare
    share = CoreShare.open(sys.argv[1], 0, "prefill", threads=1)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "busy":
            share.before_step()
        else:
            share.after_work()
        print("ok", flush=True)
"""


def test_two_processes_share_the_cores_and_results_stay_equal(lease, serial_afterwards):
    packed = quant_int4.pack(torch.randn(4096, 576), None, torch.device("cpu"), layout="q4_1")
    x = torch.randn(4, 576)
    expected = quant_int4.int4_linear_native(x, packed)  # serial
    share = CoreShare.open(str(lease.path), 1, "decode", threads=1)
    share.size_pool()
    prefill = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PREFILL), str(lease.path)],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def prefill_says(word: str) -> None:
        prefill.stdin.write(word + "\n")
        prefill.stdin.flush()
        assert prefill.stdout.readline().strip() == "ok"

    def decode_steps(n: int = 200) -> int:
        """n 'steps' of one GEMV each, the lease read before each; the most threads a call used."""
        native.peak_threads(reset=True)
        for _ in range(n):
            share.before_step()
            assert torch.equal(quant_int4.int4_linear_native(x, packed), expected)
        return native.peak_threads()

    try:
        assert prefill.stdout.readline().strip() == "ready"
        assert lease.pid(0) == prefill.pid
        prefill_says("busy")
        assert decode_steps() == 1 and native.active() == 1  # never more than its own share
        prefill_says("idle")
        assert decode_steps() <= 2 and native.active() == 2
        prefill_says("busy")
        assert decode_steps() == 1
    finally:
        prefill.kill()
        prefill.wait()
    assert decode_steps(1) <= 2 and native.active() == 2  # killed while busy: lent again
    share.close()


def test_a_share_that_does_not_match_its_slot_is_refused(lease):
    with pytest.raises(ValueError, match="slot 1 gives 1 threads, this worker has --threads 2"):
        CoreShare(lease, 1, "decode", threads=2)
    with pytest.raises(ValueError, match="not a prefill worker's"):
        CoreShare(lease, 1, "prefill")
    with pytest.raises(ValueError, match="not 'colocated' ones"):
        CoreShare(lease, 1, "colocated")
