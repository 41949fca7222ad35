"""The device an engine runs on: its weights, KV cache, batch tensors and sampling.

    --device cpu        the CPU fast paths (kernels/native.py, aten)
    --device cuda       the current CUDA device; cuda:N a given one; Triton kernels
    --device auto       cuda when a CUDA device is visible, else cpu (the default)

Resolved once, at start-up (`resolve_device`): asking for CUDA on a host without a usable
CUDA device is a ValueError naming the choice, before any model loads, instead of a failure
deep in the first forward pass. Logits are fp32 on every device. Which kernels run on the
device's tensors is kernels/_triton.py's choice (Triton for CUDA tensors by default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported only by resolve_device: the CLI parsers and launchers that check a
# --device flag stay torch-free.
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DEFAULT_DEVICE = "auto"  # of every command that runs a model (--device)
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class DeviceConfig:
    """A resolved device: `torch_device` is what tensors are placed on."""

    spec: str  # what was asked for ("auto", "cuda:1", ...)
    torch_device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"


def resolve_device(spec: str | torch.device | None = "auto") -> DeviceConfig:
    """`spec` (one of DEVICE_CHOICES, a torch.device, or None for auto) -> DeviceConfig;
    ValueError for a bad spec or a CUDA device this host does not have."""
    import torch

    if isinstance(spec, torch.device):
        spec = str(spec)
    spec = "auto" if spec is None else check_device_spec(spec).strip().lower()
    match = _SPEC.match(spec)
    kind, index = match.group(1), match.group(2)
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return DeviceConfig(spec, torch.device("cpu"))
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asks for CUDA, but this host has no usable CUDA device "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                         f"use --device cpu or auto")
    count = torch.cuda.device_count()
    n = torch.cuda.current_device() if index is None else int(index)
    if n >= count:
        raise ValueError(f"device {spec!r}: this host has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return DeviceConfig(spec, torch.device("cuda", n))


def check_device_spec(spec: str) -> str:
    """`spec` if it is well formed (not whether this host has it: a launcher checks the flags
    of workers that may run on other hosts); ValueError otherwise."""
    match = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    if match is None or (match.group(1) != "cuda" and match.group(2) is not None):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {spec!r}")
    return spec


def add_device_flags(parser) -> None:
    """--device and --no-cuda-graphs, on every command that runs a model."""
    parser.add_argument("--device", default=DEFAULT_DEVICE,
                        help="where the model, its KV cache and sampling run: cpu, cuda, cuda:N, "
                             "or auto (cuda when available, else cpu; default)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode steps eagerly on CUDA instead of replaying CUDA graphs "
                             "(vLLM's --enforce-eager)")
