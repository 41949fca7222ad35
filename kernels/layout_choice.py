"""Pick the fastest weight layout of a format on this host, by measurement, once.

Kernel speed differs between hosts of one machine kind far more than a constant can capture
(aten's int4 GEMV reads ~18 GB/s on one AVX-512 host and ~2 GB/s on an AVX2 one), so where a
format has two CPU kernels the choice is timed at first use and remembered in
$TANDEM_HOME/native/layouts.json, keyed by format, CPU model and flags, torch version, the
native kernels' source digest and the timing method's version, aten dispatch level and, above
1, the native kernels' thread count. Deleting the file re-measures. The choice is logged.

Whether a decode step streams the weights from memory or finds them in the last-level cache
changes the winner too (Sapphire Rapids class, 105 MB L3, one thread, int4: aten's kernel ran
the 135M default model's linears in 18 ms a step against the native kernel's 24, and a 1.07B
model's, 600 MB streamed, in 148 ms against 82), so a model whose layers outgrow the cache
(model_weights around its packing) has a choice of its own, timed over matrices that do not
fit in the cache either.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels import native

log = logging.getLogger("tandem.kernels")
_memo: dict[str, str] = {}
# Weights of the model whose layers are being packed (model_weights); 0: none known.
_model_weights: contextvars.ContextVar[int] = contextvars.ContextVar("tandem_model_weights", default=0)
# Whether the layers being packed run prompt-sized passes only (prompt_passes).
_prompt_passes: contextvars.ContextVar[bool] = contextvars.ContextVar("tandem_prompt_passes", default=False)
_FALLBACK_CACHE_BYTES = 32 << 20  # where sysfs does not say
ROUNDS = 3  # alternations of the candidates when timing them
# How candidates are timed; in the key, so choices made by an earlier method are measured
# again (every format's, as the key is shared: a few seconds once per host). 2: each timed
# shape's best round kept apart (_choose).
TIMING = 2
# Entered around each timing (set_timing_guard): where the choice is made for more native
# threads than the process may use right now (a decode worker borrowing an idle prefill
# worker's core), the process's worker makes the measured conditions hold first.
_timing_guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def set_timing_guard(guard: Callable[[], contextlib.AbstractContextManager] | None) -> None:
    """guard(): a context manager entered while layouts are timed, e.g. one that waits until
    the cores this process's native pool counts on are free and lets the pool use them all
    (worker/core_share.py CoreShare.timing_guard): the key names the pool's size, so the
    measurement must use it. None restores the default (nothing)."""
    global _timing_guard
    _timing_guard = guard or contextlib.nullcontext


@contextlib.contextmanager
def model_weights(count: int):
    """Layers packed inside belong to a model of `count` weights in all (its layers' matrices):
    the layout choices made there know whether a decode step reads them from memory."""
    token = _model_weights.set(count)
    try:
        yield
    finally:
        _model_weights.reset(token)


@contextlib.contextmanager
def prompt_passes(only: bool = True):
    """Layers packed inside run prompt-sized passes only (a prefill worker's copy, a colocated
    engine's prefill copy) when `only`: a layout choice that has a kernel made for many rows
    takes it there rather than the one measured at decode sizes (quant_int4.default_layout,
    quant_q6_k.default_layout)."""
    token = _prompt_passes.set(only)
    try:
        yield
    finally:
        _prompt_passes.reset(token)


def runs_prompt_passes() -> bool:
    """Whether the layers being packed run prompt-sized passes only (prompt_passes)."""
    return _prompt_passes.get()


@functools.cache  # asked once per matrix packed; the host's caches do not change under us
def last_level_cache_bytes() -> int:
    """The largest CPU cache of cpu0 (sysfs), or 32 MiB where it is not listed."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=_FALLBACK_CACHE_BYTES)


def streams_weights(bytes_per_weight: float) -> bool:
    """Whether the model being packed (model_weights), at this many bytes a weight, outgrows
    the last-level cache: a decode step then reads its layers from memory."""
    return _model_weights.get() * bytes_per_weight > last_level_cache_bytes()


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
    # The thread counts only where one is not 1 (the serial choices already recorded stay
    # valid): a threaded native kernel may beat aten's where a serial one did not, and aten's
    # kernel runs on torch's threads, which a decode worker keeps at 1 while its pool has more
    # (worker/runtime.py). A choice measured with torch at 2 (aten's kernel on both cores) had
    # been reused by such a worker: aten's kernel then ran on one core, 0.52x llama.cpp's
    # 2-thread decode on an AMD EPYC host.
    native_n, torch_n = native.threads(), torch.get_num_threads()
    threads = f"|threads {native_n} torch {torch_n}" if (native_n, torch_n) != (1, 1) else ""
    # The native sources' digest: a changed kernel is measured again rather than losing to a
    # choice made against its predecessor.
    kernels = f"native {native.source_digest()[:12]} timing {TIMING}"
    return f"{fmt}|{cpu}|{digest}|torch {torch.__version__}|{kernels}|{native.dispatch_level()}{threads}"


def fastest_layout(fmt: str, candidates: list[str], time_layout: Callable[[str], float | Sequence[float]],
                   variant: str = "") -> str:
    """time_layout(candidate): its seconds, or its seconds per timed shape (time_decode_passes:
    M = 1 and M = 8), each shape's best round then kept apart (_choose) and the bests summed.
    variant (e.g. "streamed"): a workload with a choice of its own, the key's last part."""
    key = host_key(fmt) + (f"|{variant}" if variant else "")
    label = f"{fmt} ({variant})" if variant else fmt  # for the log
    if key not in _memo:
        path = native.cache_root() / "layouts.json"
        # One measurement per host: processes starting together (a prefill and a decode worker)
        # wait on the lock and read the first one's choice, so they never run different kernels.
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # native_cache.py
            lock = open(path.with_suffix(".lock"), "w")
        except OSError as e:  # an unwritable cache: measure for this process alone
            log.warning("layout cache %s unusable (%s); measuring for this process only", path, e)
            _memo[key] = _choose(key, path, label, candidates, time_layout)
        else:
            with lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                _memo[key] = _choose(key, path, label, candidates, time_layout)
    return _memo[key]


def _choose(key: str, path: Path, fmt: str, candidates: list[str],
            time_layout: Callable[[str], float | Sequence[float]]) -> str:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    choice = table.get(key)
    if choice not in candidates:
        # Candidates in turn, ROUNDS times, each keeping its best: a burst of load from another
        # process then costs every candidate a round rather than deciding the choice. (Timed
        # once each, in sequence, a native kernel at 2 threads lost to aten's at 1 while tests
        # ran beside it on a 2-core host, and the slower kernel was remembered for every later
        # decode worker: a lone stream's TPOT 11 -> 20 ms.)
        # Per shape, too: a candidate's rounds each time M = 1 and M = 8 one after the other, and
        # a burst in either shape's pass spoils the whole round's sum. Summed per round, two
        # kernels within 7% of each other at M = 1 and 5-16% apart at M = 8 (Q6_K, 2 threads,
        # weights streamed) differed by 1-11% a round, inside the noise, and the slower one had
        # been recorded: the 1B Q4_K_M's batch of 8 then ran ~10% slower at the same b=1 speed.
        best: dict[str, list[float]] = {}
        with _timing_guard():
            for _ in range(ROUNDS):
                for c in candidates:
                    t = time_layout(c)
                    shapes = [float(t)] if isinstance(t, (int, float)) else [float(x) for x in t]
                    best[c] = [min(a, b) for a, b in zip(best[c], shapes)] if c in best else shapes
        times = {c: sum(shapes) for c, shapes in best.items()}
        choice = min(times, key=times.get)
        log.info("%s layout on this host: %s (measured %s)", fmt, choice,
                 ", ".join(f"{c} {t * 1e6:.0f} us" + (f" ({' + '.join(f'{x * 1e6:.0f}' for x in best[c])})"
                                                       if len(best[c]) > 1 else "")
                           for c, t in times.items()))
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


def time_decode_passes(packed, forward: Callable, copies: int, reps: int, warmups: int = 1) -> tuple[float, float]:
    """Seconds of forward(x, layer) over `copies` distinct copies of one packed layer at M = 1
    and at M = 8, each the best of `reps` (`copies` large enough to fill twice the last-level
    cache makes each call read its weights from memory): a candidate's times for the choice
    above."""
    import dataclasses
    import time

    gen = torch.Generator().manual_seed(1)
    layers = [packed] + [
        dataclasses.replace(packed, **{f.name: getattr(packed, f.name).clone()
                                       for f in dataclasses.fields(packed)
                                       if isinstance(getattr(packed, f.name), torch.Tensor)})
        for _ in range(copies - 1)]
    xs = [torch.randn(m, packed.in_features, generator=gen) for m in (1, 8)]
    for _ in range(warmups):  # aten's first calls pay one-time costs
        for x in xs:
            forward(x, packed)
    best = [float("inf")] * len(xs)
    for _ in range(reps):
        for i, x in enumerate(xs):
            t0 = time.perf_counter()
            for layer in layers:
                forward(x, layer)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]
