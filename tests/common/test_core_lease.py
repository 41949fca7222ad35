"""The host's core lease file (common/core_lease.py): created whole, read and written by two
processes, what a decode worker may run with idle or busy prefill workers (a dead one counts
idle), removed by its maker, a stale one (its launcher gone) reclaimed, a live one kept, and
bad files and slots refused with the path named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.core_lease import PREFIX, CoreLease, Slot, lease_path, reclaim_stale

ROOT = Path(__file__).resolve().parents[2]
ONE_EACH = [Slot("prefill", 1), Slot("decode", 1)]


@pytest.fixture
def shm(tmp_path) -> Path:
    return tmp_path  # lease_path(directory=...) keeps the tests out of /dev/shm


def other_process(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


# A prefill worker's side, in its own process: claim slot 0, then busy/idle on command.
PREFILL = """
    import os, sys
    from common.core_lease import CoreLease
    lease = CoreLease.open(sys.argv[1])
    lease.claim(0, "prefill")
    print("claimed", os.getpid(), flush=True)
    for line in sys.stdin:
        lease.set_busy(0, line.strip() == "busy")
        print("ok", flush=True)
"""


def test_a_lease_is_shared_by_two_processes_and_removed_by_its_maker(shm):
    path = lease_path("11434", directory=str(shm))
    assert path.name == f"{PREFIX}11434-{os.getpid()}"
    lease = CoreLease.create(path, ONE_EACH, cores=2)
    assert path.exists() and oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in shm.iterdir()] == [path.name]  # no temporary file left
    assert lease.slots == tuple(ONE_EACH) and lease.host_cores == 2
    assert lease.most_threads(1) == 2 and lease.threads_now(1) == 2  # prefill unclaimed: idle

    prefill = other_process(PREFILL, str(path))
    try:
        word, pid = prefill.stdout.readline().split()
        assert word == "claimed" and lease.pid(0) == int(pid) == prefill.pid
        for state, threads in (("busy", 1), ("idle", 2), ("busy", 1)):
            prefill.stdin.write(state + "\n")
            prefill.stdin.flush()
            assert prefill.stdout.readline().strip() == "ok"
            assert lease.busy(0) is (state == "busy")
            assert lease.threads_now(1) == threads
    finally:
        prefill.kill()
        prefill.wait()
    # Killed while busy: its busy word still says 1, but a dead worker lends its cores.
    assert lease._words[4 + 2] == 1
    assert not lease.busy(0) and lease.threads_now(1) == 2
    lease.unlink()
    assert not path.exists()


def test_a_prefill_worker_claims_its_slot_busy_loading_and_its_restart_again(shm):
    lease = CoreLease.create(lease_path("c", directory=str(shm)), ONE_EACH, cores=2)
    lease.claim(0, "prefill")
    assert lease.busy(0) and lease.threads_now(1) == 1  # loading: its core is not lent yet
    lease.set_busy(0, False)
    assert lease.threads_now(1) == 2
    lease.claim(0, "prefill")  # the same slot again, as a restart does: loading again
    assert lease.busy(0) and lease.threads_now(1) == 1
    lease.claim(1, "decode")
    assert not lease.busy(1)
    lease.unlink()


def test_the_launcher_starts_the_prefill_slots_busy_under_its_own_pid(shm):
    """Before a prefill worker has started far enough to claim its slot, its core is already
    taken by its start-up: a decode worker timing its kernels then waits (CoreShare.timing_guard)."""
    lease = CoreLease.create(lease_path("c", directory=str(shm)), ONE_EACH, cores=2, loading_pid=os.getpid())
    assert lease.busy(0) and lease.pid(0) == os.getpid() and not lease.busy(1)
    assert lease.threads_now(1) == 1
    lease.unlink()


@pytest.mark.parametrize("slots,cores,busy,expected", [
    # (slots, host cores, busy prefill slots, threads_now of the first decode slot)
    ([Slot("prefill", 1), Slot("decode", 1)], 2, (), 2),
    ([Slot("prefill", 1), Slot("decode", 1)], 1, (), 1),          # never beyond the host
    ([Slot("prefill", 2), Slot("decode", 2)], 4, (0,), 2),        # busy: its own share only
    ([Slot("prefill", 2), Slot("decode", 2)], 2, (), 2),          # own share even over the host
    ([Slot("prefill", 1), Slot("prefill", 1), Slot("decode", 1)], 3, (0,), 2),
    ([Slot("prefill", 1), Slot("decode", 1), Slot("decode", 1)], 3, (), 1),  # 1 core, 2 decoders
    ([Slot("prefill", 2), Slot("decode", 1), Slot("decode", 1)], 4, (), 2),  # shared evenly
])
def test_what_a_decode_worker_may_run(shm, slots, cores, busy, expected):
    lease = CoreLease.create(lease_path("c", directory=str(shm)), slots, cores=cores)
    for i in busy:
        lease.claim(i, "prefill")
        lease.set_busy(i, True)
    decode = next(i for i, s in enumerate(slots) if s.role == "decode")
    assert lease.threads_now(decode) == expected
    assert lease.most_threads(decode) >= expected
    lease.unlink()


def test_a_stale_lease_is_reclaimed_and_a_live_one_kept(shm):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = CoreLease.create(lease_path("c", int(gone.stdout), directory=str(shm)), ONE_EACH)
    stale.close()
    live = CoreLease.create(lease_path("c", directory=str(shm)), ONE_EACH)
    (shm / "tandem-kv-decode-0-1").write_bytes(b"")  # another prefix: not a lease, not touched
    assert reclaim_stale(directory=str(shm)) == [stale.path.name]
    assert sorted(p.name for p in shm.iterdir()) == sorted([live.path.name, "tandem-kv-decode-0-1"])
    live.unlink()


def test_bad_leases_and_slots_are_refused_naming_the_path(shm):
    missing = shm / "tandem-cores-x-1"
    with pytest.raises(ValueError, match=f"cannot open the core lease {missing}"):
        CoreLease.open(missing)
    junk = shm / "junk"
    junk.write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match=f"{junk} is not a tandem core lease"):
        CoreLease.open(junk)
    short = shm / "short"
    short.write_bytes(b"TDM")
    with pytest.raises(ValueError, match="too short"):
        CoreLease.open(short)
    lease = CoreLease.create(shm / "ok", ONE_EACH)
    with pytest.raises(ValueError, match="slots 0..1, not 2"):
        lease.claim(2, "decode")
    with pytest.raises(ValueError, match="slot 0 is a prefill worker's, not a decode worker's"):
        lease.claim(0, "decode")
    with pytest.raises(ValueError, match="not a decode worker's"):
        lease.most_threads(0)
    lease.unlink()
    for slots in ([], [Slot("colocated", 1)], [Slot("decode", 0)]):
        with pytest.raises(ValueError, match="core lease"):
            CoreLease.create(shm / "bad", slots)
    with pytest.raises(ValueError, match="cluster name"):
        lease_path("a/b")
