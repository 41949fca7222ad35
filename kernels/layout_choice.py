"""Pick the fastest weight layout of a format on this host, by measurement, once.

Kernel speed differs between hosts of one machine kind far more than a constant can capture
(aten's int4 GEMV reads ~18 GB/s on one AVX-512 host and ~2 GB/s on an AVX2 one), so where a
format has two CPU kernels the choice is timed at first use and remembered in
$TANDEM_HOME/native/layouts.json, keyed by format, CPU model and flags, torch version, the native kernels' source digest, aten
dispatch level and, above 1, the native kernels' thread count. Deleting the file re-measures. The choice is logged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import native

log = logging.getLogger("tandem.kernels")
_memo: dict[str, str] = {}


def host_key(fmt: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = next((ln.split(":", 1)[1] for ln in lines if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    # The thread count only where it is not 1: a threaded native kernel may beat aten's where a
    # serial one did not, and the serial choices already recorded stay valid.
    threads = f"|threads {native.threads()}" if native.threads() != 1 else ""
    # The native sources' digest: a changed kernel is measured again rather than losing to a
    # choice made against its predecessor.
    kernels = f"native {native.source_digest()[:12]}"
    return f"{fmt}|{cpu}|{digest}|torch {torch.__version__}|{kernels}|{native.dispatch_level()}{threads}"


def fastest_layout(fmt: str, candidates: list[str], time_layout: Callable[[str], float]) -> str:
    key = host_key(fmt)
    if key not in _memo:
        path = native.cache_root() / "layouts.json"
        # One measurement per host: processes starting together (a prefill and a decode worker)
        # wait on the lock and read the first one's choice, so they never run different kernels.
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # native_cache.py
            lock = open(path.with_suffix(".lock"), "w")
        except OSError as e:  # an unwritable cache: measure for this process alone
            log.warning("layout cache %s unusable (%s); measuring for this process only", path, e)
            _memo[key] = _choose(key, path, fmt, candidates, time_layout)
        else:
            with lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _memo[key] = _choose(key, path, fmt, candidates, time_layout)
    return _memo[key]


def _choose(key: str, path: Path, fmt: str, candidates: list[str],
            time_layout: Callable[[str], float]) -> str:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    choice = table.get(key)
    if choice not in candidates:
        times = {c: time_layout(c) for c in candidates}
        choice = min(times, key=times.get)
        log.info("%s layout on this host: %s (measured %s)", fmt, choice,
                 ", ".join(f"{c} {t * 1e6:.0f} us" for c, t in times.items()))
        table[key] = choice
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache only costs a re-measurement next time
            log.warning("could not record the layout choice in %s: %s", path, e)
    else:
        log.info("%s layout on this host: %s (measured earlier, %s)", fmt, choice, path)
    return choice
