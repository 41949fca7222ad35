"""Optional Triton import, shared by every kernel file.

Triton is an optional dependency (`pip install tandem[triton]`): the product must import and run
on a machine without it. Kernel files define their `@triton.jit` functions under `if HAS_TRITON:`
and their dispatchers ask `use_triton(tensor)` before launching one.

Under TRITON_INTERPRET=1 (set by tests/conftest.py before any kernel is decorated) the kernels
also run on CPU tensors; tests call the Triton launchers directly for that, or switch the whole
product to them (the "triton" path below), while under the default path `use_triton` stays False
on the CPU so that the product takes the CPU fast paths there.

The kernel path (`TANDEM_KERNELS`, read once at import; `kernel_path` switches it for a block):

    auto    Triton for CUDA tensors, the CPU fast paths (native / aten) otherwise (default)
    triton  Triton for every tensor: CUDA ones, and CPU ones under TRITON_INTERPRET=1, so
            that tests run the whole model through the Triton launchers on a CPU-only host
    torch   never Triton: the CPU fast paths, plain torch ops on a GPU

Weight layouts are chosen when a layer is packed (`triton_layouts`), so a model must be built
under the path it will run with. Every Triton launcher calls `record_launch(name)`: a Counter
(`launches`) that lets a test prove each kernel ran in place in the model (a CUDA graph replay
launches without Python, so it counts its kernels once, at capture).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Iterator

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the CPU-only install
    triton = None
    tl = None
    HAS_TRITON = False


KERNEL_PATHS = ("auto", "triton", "torch")
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Launches per Triton kernel name since start-up (or the last clear()); a dict increment per
# launch, negligible beside a kernel launch.
launches: Counter[str] = Counter()


def check_kernel_path(path: str) -> str:
    """`path` if valid here, else ValueError naming why (checked once, at start-up)."""
    if path not in KERNEL_PATHS:
        raise ValueError(f"TANDEM_KERNELS must be one of {', '.join(KERNEL_PATHS)}, got {path!r}")
    if path == "triton" and not HAS_TRITON:
        raise ValueError("TANDEM_KERNELS=triton needs triton installed (pip install tandem[triton])")
    if path == "triton" and not INTERPRETER and not torch.cuda.is_available():
        raise ValueError("TANDEM_KERNELS=triton on a host without CUDA needs TRITON_INTERPRET=1 "
                         "(set before the kernels are imported)")
    return path


_path = check_kernel_path(os.environ.get("TANDEM_KERNELS", "auto") or "auto")


def current_kernel_path() -> str:
    return _path


@contextlib.contextmanager
def kernel_path(path: str) -> Iterator[None]:
    """Runs the block under another kernel path (tests: "triton" on CPU tensors). Build the
    model inside the block too: layouts are chosen at pack time."""
    global _path
    previous, _path = _path, check_kernel_path(path)
    try:
        yield
    finally:
        _path = previous


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the op on `tensor` runs its Triton kernel: CUDA tensors under "auto", every
    tensor under "triton" (check_kernel_path made sure CPU ones can), none under "torch"."""
    if _path == "auto":
        return HAS_TRITON and tensor.is_cuda
    return _path == "triton"


def triton_layouts(device: torch.device) -> bool:
    """Whether layers packed for `device` take the Triton kernels' weight layouts."""
    if _path == "auto":
        return HAS_TRITON and device.type == "cuda"
    return _path == "triton"


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """What the weight-only Triton GEMMs take their activations in: bf16 on a GPU (tensor
    cores), fp32 on CPU tensors, because the interpreter computes bf16 dots wrongly."""
    return torch.bfloat16 if x.is_cuda else torch.float32


def gemm_tiles(m: int, on: torch.Tensor, max_block_m: int = 64) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the GEMM/GEMV kernels for M rows of `on`'s device: a GEMV
    tile for decode, tensor-core tiles otherwise. A whole model run through the interpreter (the
    "triton" path on CPU tensors) takes large tiles: the interpreter runs every program's ops
    one after the other as numpy calls, so a pass costs per program and loop step, not per
    FLOP (the default model's pass ~6x faster). Launchers called directly (the kernel tests,
    under "auto") keep the GPU's tiles, so grids and K loops of many steps stay tested; GPUs
    never take the large tiles."""
    block_m = 1 if m == 1 else min(max_block_m, max(16, triton.next_power_of_2(m)))
    if INTERPRETER and not on.is_cuda and _path == "triton":
        return block_m, 1024, 512
    return (1, 64, 128) if m == 1 else (block_m, 64, 64)


def record_launch(name: str) -> None:
    launches[name] += 1
