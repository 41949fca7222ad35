"""A worker's side of its host's core lease (common/core_lease.py): the cores idle in one role
serve the other.

- A prefill worker marks its slot busy from the moment it has a pass to run until it has none
  left (between the chunks of one prompt it stays busy), and idle when it waits (nothing to do,
  or stalled on a full pool).
- A decode worker's native pool is started once with the most threads the lease can give it
  (its --threads plus its part of the prefill workers'); before every engine step it reads the
  lease and sets the pool's active limit (kernels/native.py `set_active`: the threads over it
  sleep, none is started or stopped) to its own share while any prefill worker is busy, and
  to its share plus the idle prefill workers' otherwise. Results do not depend on the limit
  (kernels/csrc/thread_pool.h), so sharing changes speed only. A prefill that arrives waits at
  most the rest of one decode step for the cores it lent; torch stays at one thread.

Why the decode side borrows and the prefill side does not: a decode step is a few ms, so the
decode worker gives borrowed cores back within one step of a prefill starting; a prefill pass
is hundreds of ms of aten GEMMs whose OpenMP thread count is fixed for the pass, so a prefill
worker that borrowed the decode worker's core would hold it while decode streams start (their
first tokens come from this very pass) and every one of their steps would wait on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from common.core_lease import CoreLease

log = logging.getLogger("tandem.cores")


class CoreShare:
    """One worker's slot of a lease. `before_step` / `after_work` are the engine thread's
    (worker/engine_loop.py); `pool_threads` sizes the native pool once, before the engine."""

    def __init__(self, lease: CoreLease, slot: int, role: str, threads: int | None = None) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"a core lease is shared by prefill and decode workers, not {role!r} ones")
        lease._check(slot, role)
        if threads is not None and lease.slots[slot].threads != threads:
            raise ValueError(f"core lease {lease.path}: slot {slot} gives {lease.slots[slot].threads} "
                             f"threads, this worker has --threads {threads}")
        lease.claim(slot, role)
        self.lease, self.slot, self.role = lease, slot, role
        self.own = lease.slots[slot].threads
        self._busy = role == "prefill"  # claim() marks a prefill worker busy: it is loading
        self._active = 0  # the limit last given to the native pool (0: not yet)
        self.changes = 0  # times the limit changed (status, tests)

    @classmethod
    def open(cls, path: str, slot: int, role: str, threads: int | None = None) -> CoreShare:
        lease = CoreLease.open(path)
        try:
            return cls(lease, slot, role, threads)
        except ValueError:
            lease.close()
            raise

    def pool_threads(self) -> int:
        """The native pool's size: the most this worker may ever run (its own share for a
        prefill worker, which borrows nothing)."""
        return self.lease.most_threads(self.slot) if self.role == "decode" else self.own

    def size_pool(self) -> None:
        """Make the native pool as large as the lease can ever make it, limited to this
        worker's own share until the first step's `before_step` (after configure_process,
        which sized it to --threads)."""
        from kernels import native

        if self.pool_threads() > self.own:
            native.set_active(self.own)
            native.set_threads(self.pool_threads())
            self._active = self.own

    @contextlib.contextmanager
    def timing_guard(self, timeout_s: float = 120.0):
        """While kernels are timed for this process (kernels/layout_choice.py, whose choice is
        keyed by the pool's size): wait until every core the pool may borrow is free (the
        prefill workers are loaded and idle; at most timeout_s), and let the pool use them all.
        Without this a decode worker timed its threaded kernel with its own share only, at
        start-up, beside the prefill worker's model load, and remembered aten's serial kernel
        as the faster one for every later start (a lone stream's TPOT 11 -> 20 ms)."""
        from kernels import native

        if self.role != "decode" or self.pool_threads() == self.own:
            yield
            return
        deadline = time.monotonic() + timeout_s
        while self.lease.threads_now(self.slot) < self.pool_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        before = native.active()
        native.set_active(self.pool_threads())
        try:
            yield
        finally:
            native.set_active(before)

    def describe(self) -> str:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        what = (f"native pool of {self.pool_threads()} threads, {self.own} of them its own, the "
                f"rest while no prefill worker is busy" if self.role == "decode"
                else f"{self.own} threads, lent to the decode workers while idle")
        return (f"core lease {self.lease.path} slot {self.slot} ({self.role}): {what}; host cores "
                f"{self.lease.host_cores}, this process may run on cores {cores}")

    def before_step(self) -> None:
        if self.role == "prefill":
            if not self._busy:
                self.lease.set_busy(self.slot, True)
                self._busy = True
            return
        from kernels import native

        n = self.lease.threads_now(self.slot)
        if n != self._active:
            native.set_active(n)
            self._active = n
            self.changes += 1

    def after_work(self) -> None:
        """The engine has nothing it can run now."""
        if self.role == "prefill" and self._busy:
            self.lease.set_busy(self.slot, False)
            self._busy = False

    def close(self) -> None:
        self.after_work()
        self.lease.close()
