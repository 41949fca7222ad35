"""The ports a launcher is about to give its coordinator, claimed before anything starts, so
that a second cluster on them fails at once, naming the port (and the pid holding it), instead
of half-starting or, where a server binds with SO_REUSEPORT, silently sharing it.

    with claim_ports(lock_dir, [11434, 50051], "127.0.0.1"):   # PortInUse, nothing started
        ...serve...                                            # locks held until the end

Two checks per port: a lock file `lock_dir/port-N.lock` (flock, held by the launcher for its
life, the holder's pid inside: an earlier `tandem serve` of this user that is still running),
and a test bind without SO_REUSEPORT (whatever else listens there: orphans of a launcher that
was killed, another program). The kernel drops the lock with the launcher, however it ends.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from common.errors import TandemError
from common.processes import command_line
from deploy.probe import check_listen


class PortInUse(TandemError):
    """A port the cluster needs is held; nothing was started."""


class PortClaim:
    def __init__(self) -> None:
        self._files: list[IO[str]] = []

    def __enter__(self) -> PortClaim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        for f in self._files:
            f.close()  # closing the file drops its flock
        self._files.clear()


def claim_ports(lock_dir: Path | None, ports: Iterable[int], host: str | None) -> PortClaim:
    """Lock every port (0 = any free one: skipped) and test-bind it on `host` (None: only the
    lock; `tandem launch`'s preflight tests each address on its host); PortInUse for the first
    one held."""
    claim = PortClaim()
    try:
        for port in sorted({p for p in ports if p}):
            if lock_dir is not None:
                claim._files.append(_lock(lock_dir, port))
            problem = check_listen((host or "0.0.0.0").strip("[]"), port) if host is not None else None
            if problem:
                pid = listener_pid(port)
                held = f" by pid {pid} ({command_line(pid)[:120]})" if pid else ""
                raise PortInUse(f"{problem}{held}; is an earlier tandem still running? Stop it, "
                                f"or choose another port")
    except BaseException:
        claim.release()
        raise
    return claim


def _lock(lock_dir: Path, port: int) -> IO[str]:
    lock_dir.mkdir(parents=True, exist_ok=True)
    f = open(lock_dir / f"port-{port}.lock", "a+")  # non-inheritable: children never hold it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise PortInUse(f"port {port} is held by an earlier tandem of this user, pid {pid} "
                        f"({command_line(int(pid))[:120] if pid.isdigit() else 'unknown'}); "
                        f"stop it first (kill {pid}), or choose another port") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def listener_pid(port: int) -> int | None:
    """A process of this user listening on TCP `port` in this network namespace, or None."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) in inodes:
                    return int(entry.name)
        except OSError:
            continue  # another user's process, or gone
    return None
