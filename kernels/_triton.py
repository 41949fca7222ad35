"""Optional Triton import, shared by every kernel file.

Triton is an optional dependency (`pip install tandem[triton]`): the product must import and run
on a machine without it. Kernel files define their `@triton.jit` functions under `if HAS_TRITON:`
and their dispatchers ask `use_triton(tensor)` before launching one.

Under TRITON_INTERPRET=1 (set by tests/conftest.py before any kernel is decorated) the kernels
also run on CPU tensors; tests call the Triton launchers directly for that, while `use_triton`
stays False on the CPU so that the product takes the torch fast paths there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the CPU-only install
    triton = None
    tl = None
    HAS_TRITON = False


def use_triton(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives on a CUDA device and Triton is importable."""
    return HAS_TRITON and tensor.is_cuda
