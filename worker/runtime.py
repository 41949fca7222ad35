"""Process-level settings for a worker or CLI process, applied once at its entry point.

- Torch threads: one per worker process by default; tandem runs several processes per host.
  With more than one thread, OpenMP's spinning waits cost milliseconds per op on small
  machines unless OMP_WAIT_POLICY=PASSIVE is set before torch starts, so entry points that
  spawn workers set it in the child's environment (see `worker_env`).
- Native kernel threads: the same count sizes the native kernels' own pool
  (kernels/native.py `set_threads`; no OpenMP, idle threads sleep within ~50 us), so
  `--threads 2` lets a decode worker's GEMVs and paged attention use a second core. 1 starts
  no extra thread.
- glibc malloc: large freed temporaries (attention scratch, GEMM outputs) are returned to the
  OS and page-faulted back on the next step, which can cost half of a CPU decode step. Raising
  the mmap and trim thresholds keeps them in the process (common/malloc_policy.py; model loads
  run under thresholds of their own there). Applied with mallopt at run time, so it works in
  an already-started interpreter too.
"""

from __future__ import annotations

import os

# The malloc policy lives in common/ so the engine can wrap its model loads in it.
from common.malloc_policy import keep_freed_memory, release_freed_memory

__all__ = ["configure_process", "keep_freed_memory", "release_freed_memory", "worker_env"]


def configure_process(threads: int = 1, torch_threads: int | None = None,
                      batch_invariant: bool = False) -> None:
    """`threads` for the native kernels' pool, and for torch unless `torch_threads` is given:
    a decode worker passes 1 (its steps are the native GEMVs and attention; aten's part is
    small tensors, where a second OpenMP thread cost more than it gave and took the core the
    pool needed: measured, SmolLM2-135M int4 decode 18.0 ms/token at 1 thread, 19.8 at 2+2,
    13.3 at torch 1 + native 2). batch_invariant: switch kernels/batch_invariance.py's mode
    on (it is on already where the environment has TANDEM_BATCH_INVARIANT=1)."""
    import torch

    from kernels import native

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if torch_threads is not None and torch_threads < 1:
        raise ValueError(f"torch_threads must be >= 1, got {torch_threads}")
    torch.set_num_threads(torch_threads or threads)
    native.set_threads(threads)
    if batch_invariant:
        from kernels import batch_invariance

        batch_invariance.set_enabled(True)
    keep_freed_memory()


def worker_env(threads: int = 1) -> dict[str, str]:
    """Environment for a child worker process: thread counts and OpenMP's wait policy must be
    set before the child imports torch."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    return env
