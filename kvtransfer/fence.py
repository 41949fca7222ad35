"""Is a same-host peer process still alive? The shm receiver's fence for a sender that can no
longer acknowledge a revocation.

A process is named by (pid, start time): the start time (field 22 of /proc/<pid>/stat, clock
ticks since boot) tells a recycled pid from the original. A zombie (state Z or X) counts as
gone: its address space is already torn down, so it can write nothing more.

A sender whose claimed identity the receiver cannot see at handshake (another pid namespace,
no /proc) is never fenced: its blocks come back only through its acknowledgement.
"""

from __future__ import annotations

import os

from common.processes import start_time as process_start_time  # noqa: F401 - this module's API


def own_identity() -> tuple[int, int]:
    """(pid, start time) of this process; start time 0 where /proc is missing."""
    pid = os.getpid()
    return pid, process_start_time(pid) or 0


def same_process_alive(pid: int, start_time: int) -> bool:
    return pid > 0 and process_start_time(pid) == start_time
