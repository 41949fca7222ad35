"""Processes of this host by pid and start time, which together tell a reused pid apart.
Linux /proc only; elsewhere every question answers None."""

from __future__ import annotations

import os
from pathlib import Path


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None if there is no such live
    process: a zombie (state Z or X) counts as gone, its address space is torn down."""
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


def started_at(pid: int) -> float | None:
    """The process's start as a Unix time (seconds), or None once it has exited."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""
