"""common/processes.py: a process's start time and CPU time, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from common.processes import cpu_seconds, host_steal_seconds, start_time, thread_cpu_seconds


def test_cpu_time_is_the_process_s_own_and_none_once_it_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "sum(i * i for i in range(10**7))"])
    child.wait()  # reaped: no such process any more
    assert cpu_seconds(child.pid) is None and start_time(child.pid) is None
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2 * 10**6))
    after, own = cpu_seconds(os.getpid()), time.process_time()
    assert after >= before
    # Clock ticks (1/100 s) against the kernel's exact count: the same time, coarser.
    assert abs(after - own) < 0.1


def test_thread_cpu_time_tells_the_busy_thread_apart():
    # A child whose second thread spins while its main thread sleeps.
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "def spin():\n    while True: pass\n"
                              "threading.Thread(target=spin, daemon=True).start(); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        threads = {}
        while time.monotonic() < deadline and max(threads.values(), default=0.0) < 0.3:
            threads = thread_cpu_seconds(child.pid)
            time.sleep(0.05)
        assert len(threads) == 2, threads
        busy, idle = sorted(threads.values(), reverse=True)
        assert busy >= 0.3 and idle < 0.2  # the sleeper used what starting Python took
        assert sum(threads.values()) <= cpu_seconds(child.pid) + 0.02  # read first: it only grows
    finally:
        child.kill()
        child.wait()
    assert thread_cpu_seconds(child.pid) == {}


def test_a_zombie_has_no_start_time():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(3000):  # until it has exited but is not yet reaped: state Z
        if start_time(child.pid) is None:
            break
        time.sleep(0.01)
    assert start_time(child.pid) is None, "the child never exited"
    assert cpu_seconds(child.pid) is not None  # the zombie's stat is still there to read
    child.wait()


def test_host_steal_is_the_eighth_cpu_field(tmp_path):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    stat.write_text(f"cpu  10 0 5 900 1 0 2 {3 * tick} 0 0\ncpu0 1 2 3\n")
    assert host_steal_seconds(stat) == 3.0
    stat.write_text("cpu  10 0 5 900 1 0 2\n")  # a kernel before 2.6.11 counts no steal
    assert host_steal_seconds(stat) is None
    assert host_steal_seconds(tmp_path / "absent") is None
