"""The shared-memory KV pools a decode worker makes for `--kv-backend shm` (kvtransfer's
ShmReceiver), named after their owner's pid so that anyone can tell an orphan:

    /dev/shm/tandem-kv-<worker id>-<pid>        the cache pool (~1 GB by default)
    /dev/shm/tandem-kv-<worker id>-<pid>-own    its owner table

A segment outlives its owner when the owner dies without closing it (SIGKILL, OOM). It is an
orphan when no process has that pid, or when the process that has it started after the
segment was last written (the pid was reused): a live owner started before making it. Orphans
are reclaimed when the next shm decode worker starts (`reclaim_orphans()`), and `tandem serve`
removes its own workers' segments when it stops (`reclaim_orphans(owners=...)`).

The same rule, with `prefix=`, reclaims other per-process files of /dev/shm: the core lease
of a launcher (common/core_lease.py, `tandem-cores-<cluster>-<launcher pid>`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from common.processes import started_at

SHM_DIR = "/dev/shm"
PREFIX = "tandem-kv-"


def _name_pattern(prefix: str) -> re.Pattern:
    return re.compile(rf"^{re.escape(prefix)}.+-(\d+)(-own)?$")


_NAME = _name_pattern(PREFIX)


def free_bytes(directory: str = SHM_DIR) -> int | None:
    """Bytes this user may still allocate in `directory` (a tmpfs: what a new segment's pages
    can take before touching one more kills the process with SIGBUS); None where it is not
    there."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def segment_name(worker_id: str, pid: int | None = None) -> str:
    return f"{PREFIX}{worker_id}-{os.getpid() if pid is None else pid}"


def owner_pid(name: str, prefix: str = PREFIX) -> int | None:
    match = (_NAME if prefix == PREFIX else _name_pattern(prefix)).match(name)
    return int(match.group(1)) if match else None


def _orphaned(path: str, pid: int) -> bool:
    try:
        written = os.stat(path).st_mtime
    except OSError:
        return False  # already gone
    start = started_at(pid)
    return start is None or start > written + 1.0  # +1 s: btime and tick rounding


def reclaim_orphans(owners: Iterable[int] | None = None, directory: str = SHM_DIR,
                    prefix: str = PREFIX) -> list[str]:
    """Unlink this user's tandem segments (names starting with `prefix`) whose owner is gone
    (only those of `owners`' pids when given); the names removed."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []  # no /dev/shm: not Linux
    wanted = None if owners is None else set(owners)
    removed = []
    for name in names:
        pid = owner_pid(name, prefix)
        path = os.path.join(directory, name)
        if pid is None or (wanted is not None and pid not in wanted):
            continue
        try:
            if os.stat(path).st_uid != os.getuid() or not _orphaned(path, pid):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def unlink_own(directory: str = SHM_DIR) -> list[str]:
    """Unlink this process's segments (their mappings stay valid until unmapped): the last
    act of a worker whose launcher is gone, in case it is killed before its own cleanup."""
    pid = os.getpid()
    removed = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if owner_pid(name) == pid:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed
