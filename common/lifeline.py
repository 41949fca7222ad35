"""A child's tie to the launcher that started it on the same host (`tandem serve`, the local
part of `tandem launch`), so that no process of a cluster outlives its launcher, however the
launcher ends (SIGHUP, SIGKILL, an OOM kill).

    launcher                                   child (coordinator, worker)
    line = Lifeline()        a pipe; only the launcher holds its write end
    Popen(..., pass_fds=line.pass_fds,
          env={**env, **line.child_env()})  -> watch_launcher() at start-up: a thread blocks
                                               reading the read end
    (launcher ends: the kernel closes the      read() returns EOF: unlink this process's KV
     write end)                                segments, SIGTERM to itself (its own orderly
                                               stop), os._exit after `grace_s` if still alive

A pipe rather than prctl(PR_SET_PDEATHSIG) for Python children: the death signal fires when
the *thread* that forked exits, not the process, and a launcher may restart a worker from any
thread. Children that are not tandem processes (an ssh client) cannot watch a pipe; they get
the death signal instead (`death_signal()`, a preexec_fn), which is sound when the forking
thread is the main thread, as it is in `tandem launch`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

ENV = "TANDEM_LIFELINE_FD"
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("tandem.lifeline")


class Lifeline:
    """The launcher's end. Both ends are non-inheritable: a child gets the read end through
    `pass_fds` alone, so no child ever holds the write end open."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.read_fd,)

    def child_env(self) -> dict[str, str]:
        return {ENV: str(self.read_fd)}


def watch_launcher(grace_s: float = 10.0, env: dict[str, str] | None = None) -> bool:
    """At a child's start-up: if its launcher gave it a lifeline (TANDEM_LIFELINE_FD), end this
    process once the launcher is gone. False when there is no lifeline (started by hand)."""
    value = (os.environ if env is None else env).pop(ENV, "")
    if not value.isdigit():
        return False
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:
        return False  # the variable came through a shell, not the fd
    threading.Thread(target=_watch, args=(fd, grace_s), name="lifeline", daemon=True).start()
    return True


def _watch(fd: int, grace_s: float) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        return
    from common.shm_segments import unlink_own

    removed = unlink_own()
    log.warning("the launcher that started this process is gone: stopping%s",
                f" (unlinked {', '.join(removed)})" if removed else "")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %g s after the launcher went: exiting now", grace_s)
    os._exit(1)


def death_signal(sig: int = signal.SIGTERM):
    """A preexec_fn: the kernel sends `sig` to the child when the thread that forks it exits
    (Linux; a no-op elsewhere); a child whose parent is already gone exits at once."""
    parent = os.getpid()

    def preexec() -> None:
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return preexec


# Looked up at import, not in the forked child: there, nothing but the call itself.
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True) \
    if sys.platform.startswith("linux") else None
