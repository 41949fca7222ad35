"""glibc malloc's thresholds for the two phases of a process that serves a model.

    keep_freed_memory()      serving: freed temporaries stay in the process for the next step
    loading_weights()        a with-block around building a model: every large temporary goes
                             back to the OS when it is freed; on exit the heap is trimmed and
                             the serving policy, if it was asked for, is restored
    release_freed_memory()   gc, then malloc_trim(0) once
    freeze_loaded_heap()     once loaded: the objects alive now leave the cyclic GC's reach

Serving: a decode step's large temporaries (attention scratch, GEMM outputs) would otherwise be
returned to the OS and page-faulted back on the next step, which can cost half of a CPU decode
step, so keep_freed_memory raises the mmap threshold to 1 GiB and the trim threshold to 2 GiB.

Loading under those thresholds is what ran an 8B Q4_K_M prefill worker out of memory: every
matrix is packed through full-size fp32 temporaries (dequantized blocks, then w8a8's scaled
and rounded copies), each below 1 GiB, so all of them came from the brk heap, with the packed
int8 results allocated between them; freed holes were too small or too scattered for the next
matrix's temporaries, so the heap grew by about the temporaries of every matrix and was
trimmed only after the whole model was built. Measured on the random 1B LLaMA (F16 file,
w8a8): 3.2 GiB of anonymous memory for a model holding 1.4 GiB, against 1.6 GiB without the
serving thresholds. During loading_weights the mmap threshold is 1 MiB: each temporary of a
matrix is its own mapping, unmapped when freed, and each packed tensor one of exactly its size.

Outside glibc (musl, macOS) the malloc functions do nothing and report False.

The cyclic GC: a full (generation 2) collection walks every tracked object, and a loaded worker
holds ~200,000 of them (modules, the model's modules and tensors, gRPC and kvtransfer state):
measured on the default model, 46-59 ms per full collection in a process that only built the
engine, 64-106 ms in a serving worker on a busy 2-core host, every stream of that worker
stalled meanwhile. Python runs one whenever the objects promoted since the last one reach a
quarter of those it holds, which a server reaches in time. gc.freeze() after loading moves
the loaded objects to a permanent generation that no collection walks (0.01 ms per full
collection then), as vLLM's engine core does; they are unfrozen at exit, so interpreter
shutdown still collects them (nanobind reports what it finds alive then as leaks).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from contextlib import contextmanager

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_SERVING_MMAP_THRESHOLD = 1 << 30  # glibc takes it on 64-bit (2.36: mallopt returns 1)
_SERVING_TRIM_THRESHOLD = 2**31 - 1
_LOADING_MMAP_THRESHOLD = 1 << 20
_LOADING_TRIM_THRESHOLD = 1 << 20
# Where a process that never asked to keep freed memory is left after loading: glibc's own
# dynamic threshold would stop rising at 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), with
# the trim threshold at twice it; mallopt cannot turn the dynamic rule back on.
_DEFAULT_MMAP_THRESHOLD = 32 << 20
_DEFAULT_TRIM_THRESHOLD = 64 << 20

_serving = False  # keep_freed_memory() has been asked for in this process


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse (serving). False where this is not glibc."""
    global _serving
    _serving = _set(_SERVING_MMAP_THRESHOLD, _SERVING_TRIM_THRESHOLD)
    return _serving


def release_freed_memory() -> bool:
    """Return the heap's free pages to the OS once. False where this is not glibc."""
    gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def freeze_loaded_heap() -> int:
    """Collect, then freeze every object alive now (module docstring); returns how many are
    frozen in all. Call it once a process has loaded what it keeps, before it serves."""
    gc.collect()
    gc.freeze()
    if not _frozen:
        _frozen.append(True)
        atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


_frozen: list[bool] = []  # the exit hook is registered


@contextmanager
def loading_weights() -> Iterator[None]:
    """Thresholds for building a model: peak memory is what the model holds plus one matrix's
    temporaries, not plus every matrix's (module docstring)."""
    _set(_LOADING_MMAP_THRESHOLD, _LOADING_TRIM_THRESHOLD)
    try:
        yield
    finally:
        release_freed_memory()
        if _serving:
            _set(_SERVING_MMAP_THRESHOLD, _SERVING_TRIM_THRESHOLD)
        else:
            _set(_DEFAULT_MMAP_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
