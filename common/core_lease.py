"""A host's core lease: which of the workers one launcher started on this host are computing
right now, so that a decode worker can run its native kernels on the cores of an idle prefill
worker and give them back the moment that worker has work (worker/core_share.py).

One small file in /dev/shm per launcher, made before its workers start and removed when it
stops (deploy/local.py); named after the cluster and the launcher's pid, so an orphan (the
launcher SIGKILLed) is known by the rule of common/shm_segments.py and reclaimed by the next
launcher that makes one:

    /dev/shm/tandem-cores-<cluster>-<launcher pid>

Layout (little-endian; written whole by the launcher, then only each slot's pid and busy
words, each by its own worker):

    0   8s  magic b"TDMCORE1"
    8   u32 slot count
    12  u32 host cores (the launcher's CPU affinity)
    16  slots, SLOT_BYTES each:  u8 role (1 prefill, 2 decode), u8 0, u16 threads (the
        worker's own share, its --threads), i32 pid (0 until the worker claims the slot),
        u32 busy (1 while a prefill worker has a pass to run), u32 0

Invariants: a slot's pid and busy words are written only by the process in that slot (each an
aligned 4-byte store, which every reader sees whole), and by the launcher that creates the
file, which may start the prefill slots busy under its own pid (their workers are about to
load); the rest never changes after creation. A prefill slot counts as busy only while its
busy word is 1 and its pid is alive, so a worker killed mid-pass lends its cores again; its
restart (same slot) claims it busy, as every prefill worker starts: loading its model.
Decode workers share out the idle prefill workers' threads evenly (floor), never beyond the
host's cores.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.shm_segments import SHM_DIR, reclaim_orphans

PREFIX = "tandem-cores-"
MAGIC = b"TDMCORE1"
HEADER = struct.Struct("<8sII")
SLOT = struct.Struct("<BBHiII")
SLOT_BYTES = SLOT.size
ROLES = {"prefill": 1, "decode": 2}
_ROLE_NAMES = {v: k for k, v in ROLES.items()}
MAX_SLOTS = 4096


@dataclass(frozen=True)
class Slot:
    role: str  # "prefill" or "decode"
    threads: int  # the worker's own share of cores (its --threads)


def lease_path(cluster: str, pid: int | None = None, directory: str = SHM_DIR) -> Path:
    """Where a launcher of cluster `cluster` (e.g. its HTTP port) keeps its lease."""
    if not cluster or "/" in cluster:
        raise ValueError(f"a core lease's cluster name must be non-empty and have no '/', got {cluster!r}")
    return Path(directory) / f"{PREFIX}{cluster}-{os.getpid() if pid is None else pid}"


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), which its children inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def reclaim_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's leases whose launcher is gone; the names removed."""
    return reclaim_orphans(directory=directory, prefix=PREFIX)


class CoreLease:
    """A mapped lease file. `create` (the launcher) or `open` (a worker, by path)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        try:
            size = os.fstat(fd).st_size
            if size < HEADER.size:
                raise ValueError(f"core lease {path} is {size} bytes, too short to be one")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, count, cores = HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or not 0 < count <= MAX_SLOTS or size != HEADER.size + count * SLOT_BYTES:
            self._map.close()
            raise ValueError(f"{path} is not a tandem core lease (magic {magic!r}, {count} slots, "
                             f"{size} bytes)")
        self.host_cores = cores
        self.slots = tuple(self._slot(i) for i in range(count))
        # Aligned 4-byte words: slot i's pid at word 4 + 4 i + 1, busy at 4 + 4 i + 2.
        self._words = memoryview(self._map).cast("i")

    def _slot(self, i: int) -> Slot:
        role, _, threads, _, _, _ = SLOT.unpack_from(self._map, HEADER.size + i * SLOT_BYTES)
        if role not in _ROLE_NAMES or threads < 1:
            raise ValueError(f"core lease {self.path}: slot {i} has role {role} and {threads} threads")
        return Slot(_ROLE_NAMES[role], threads)

    @classmethod
    def create(cls, path: Path, slots: Sequence[Slot], cores: int | None = None,
               loading_pid: int | None = None) -> CoreLease:
        """Write a new lease at `path` (replacing any file there), every slot unclaimed. The
        file appears whole (written aside, then renamed), so a worker never maps half of one.
        loading_pid: the prefill slots start busy under that (live) pid, the launcher's, until
        their workers claim them: their cores are taken by the workers' start-up from the first."""
        if not 0 < len(slots) <= MAX_SLOTS:
            raise ValueError(f"a core lease needs 1..{MAX_SLOTS} slots, got {len(slots)}")
        for s in slots:
            if s.role not in ROLES or not isinstance(s.threads, int) or not 0 < s.threads < 65536:
                raise ValueError(f"a core lease slot needs a role in {', '.join(ROLES)} and 1..65535 "
                                 f"threads, got {s}")
        cores = host_cores() if cores is None else cores
        loading = (loading_pid or 0, 1)
        data = HEADER.pack(MAGIC, len(slots), cores) + b"".join(
            SLOT.pack(ROLES[s.role], 0, s.threads, *(loading if loading_pid and s.role == "prefill"
                                                     else (0, 0)), 0) for s in slots)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    @classmethod
    def open(cls, path: Path | str) -> CoreLease:
        """Map an existing lease; ValueError naming the path when it is missing or not one."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ValueError(f"cannot open the core lease {path}: {exc.strerror}") from None
        return cls(path, fd)

    # -- one worker's slot ----------------------------------------------------------------

    def _check(self, slot: int, role: str | None = None) -> None:
        """ValueError unless `slot` exists (and is a `role` worker's)."""
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"core lease {self.path} has slots 0..{len(self.slots) - 1}, not {slot}")
        if role is not None and self.slots[slot].role != role:
            raise ValueError(f"core lease {self.path}: slot {slot} is a {self.slots[slot].role} "
                             f"worker's, not a {role} worker's")

    def claim(self, slot: int, role: str) -> None:
        """This process takes `slot` (a restart takes its slot again): a prefill worker busy
        (it is loading its model: its cores are not free to lend until its engine loop first
        finds nothing to do), a decode worker idle; then its pid."""
        self._check(slot, role)
        self._words[4 + 4 * slot + 2] = 1 if role == "prefill" else 0
        self._words[4 + 4 * slot + 1] = os.getpid()

    def set_busy(self, slot: int, busy: bool) -> None:
        self._words[4 + 4 * slot + 2] = 1 if busy else 0

    def pid(self, slot: int) -> int:
        return self._words[4 + 4 * slot + 1]

    def busy(self, slot: int) -> bool:
        """The slot's worker says it is computing, and it is alive."""
        if not self._words[4 + 4 * slot + 2]:
            return False
        pid = self._words[4 + 4 * slot + 1]
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False  # killed mid-pass: its cores are free
        except PermissionError:
            pass  # alive, someone else's (a reused pid): count it busy, the safe side
        return True

    # -- what a decode worker may use -----------------------------------------------------

    def most_threads(self, slot: int) -> int:
        """The most threads the decode worker in `slot` may ever run: its own share plus its
        part of every prefill worker's, within the host's cores."""
        self._check(slot, "decode")
        return self._threads(slot, busy=lambda i: False)

    def threads_now(self, slot: int) -> int:
        """The threads the decode worker in `slot` may run now: its own share plus its part of
        the idle prefill workers' shares, within the host's cores."""
        return self._threads(slot, self.busy)

    def _threads(self, slot: int, busy) -> int:
        own = self.slots[slot].threads
        decoders = sum(1 for s in self.slots if s.role == "decode")
        lent = sum(s.threads for i, s in enumerate(self.slots) if s.role == "prefill" and not busy(i))
        return max(own, min(own + lent // decoders, self.host_cores // decoders))

    def close(self) -> None:
        self._words.release()
        self._map.close()

    def unlink(self) -> None:
        """Close and remove the file (the launcher, when it stops)."""
        self.close()
        self.path.unlink(missing_ok=True)
