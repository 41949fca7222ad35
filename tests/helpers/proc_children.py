"""The live children of a process, read from /proc (tests of process lifetimes)."""

from __future__ import annotations

import os
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """Every live process whose parent is `pid` (field 4 of /proc/N/stat, read after the
    command name's closing parenthesis, which may itself hold spaces or parentheses)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid:
            found.append(int(entry))
    return found
