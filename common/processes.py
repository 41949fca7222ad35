"""Processes of this host by pid and start time, which together tell a reused pid apart.
Linux /proc only; elsewhere every question answers None."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_fields(pid: int, path: str = "") -> list[bytes] | None:
    """/proc/<pid>/stat (or `path`, another stat file) from field 3 (the state) on, or None if
    there is no such process."""
    try:
        with open(path or f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
    return stat[stat.rfind(b")") + 2:].split()


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None if there is no such live
    process: a zombie (state Z or X) counts as gone, its address space is torn down."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])  # field 22


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used so far, user and system, every thread (fields 14 and
    15), or None if there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else _cpu_from_stat(fields)


def _cpu_from_stat(fields: list[bytes]) -> float:
    """utime + stime (fields 14 and 15 of a stat line) in seconds."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """The CPU time each thread of a process has used so far, user and system, by thread id
    ({} if there is no such process; a thread that ends while read is left out)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return {}
    out = {}
    for tid in tids:
        fields = _stat_fields(pid, f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:
            out[int(tid)] = _cpu_from_stat(fields)
    return out


def host_steal_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU time the hypervisor took from this (virtual) host's CPUs so far, all of them
    together (/proc/stat's "steal"), or None where the kernel does not count it. A vCPU taken
    away freezes whatever ran on it, a stall no scheduler inside the guest can see."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


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
