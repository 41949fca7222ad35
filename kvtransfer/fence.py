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


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None if there is no such (live) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
    fields = stat[stat.rfind(b")") + 2:].split()
    state, start = fields[0], fields[19]  # fields 3 and 22
    if state in (b"Z", b"X", b"x"):
        return None
    return int(start)


def own_identity() -> tuple[int, int]:
    """(pid, start time) of this process; start time 0 where /proc is missing."""
    pid = os.getpid()
    return pid, process_start_time(pid) or 0


def same_process_alive(pid: int, start_time: int) -> bool:
    return pid > 0 and process_start_time(pid) == start_time
