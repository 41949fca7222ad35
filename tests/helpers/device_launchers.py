"""The kernel tests on a GPU: TANDEM_TEST_DEVICE=cuda (with TRITON_INTERPRET=0) runs every
Triton launcher those tests call on CUDA tensors, compiled, instead of under the interpreter.

The tests build their inputs on the CPU (seeded CPU generators, CPU references). Here every
Triton launcher is wrapped: CPU tensor arguments are copied to the device, the launcher runs
there, and its results come back, as does every argument (so the in-place outputs, the KV
caches and `out=` buffers, hold what the kernel wrote). Inputs that the kernel only read are
copied back unchanged. Tensors already on the device pass straight through, so a launcher
that calls another one (paged_attention_triton) runs the inner one on the device as is.

benchmarks/device_check.py sets the variables; unset (the default), this module changes nothing.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

LAUNCHERS = {
    "kernels.flash_attention": ("flash_attention_triton",),
    "kernels.paged_attention": ("paged_decode_triton",),
    "kernels.attention": ("paged_attention_triton",),
    "kernels.kv_cache_write": ("write_kv_cache_triton",),
    "kernels.rotary": ("apply_rotary_triton",),
    "kernels.rms_norm": ("rms_norm_triton",),
    "kernels.activation": ("silu_and_mul_triton",),
    "kernels.quant_int8": ("int8_linear_triton",),
    "kernels.quant_int4": ("int4_linear_triton",),
    "kernels.quant_w8a8": ("quantize_per_token_triton", "w8a8_gemm_triton"),
}


def target_device() -> str:
    return os.environ.get("TANDEM_TEST_DEVICE", "cpu")


def on_device(fn, device: torch.device):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        moved = {}

        def move(x):
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                moved[id(x)] = (x, x.to(device))
                return moved[id(x)][1]
            return x

        result = fn(*[move(a) for a in args], **{k: move(v) for k, v in kwargs.items()})
        for original, copy in moved.values():
            original.copy_(copy.cpu())

        def back(x):
            return x.cpu() if isinstance(x, torch.Tensor) else x

        return tuple(back(r) for r in result) if isinstance(result, tuple) else back(result)

    return run


@pytest.fixture(autouse=True)
def triton_on_test_device(monkeypatch):
    """Autouse (imported by tests/conftest.py): a no-op unless TANDEM_TEST_DEVICE is a GPU."""
    if target_device() == "cpu":
        yield
        return
    import importlib

    device = torch.device(target_device())
    for module_name, names in LAUNCHERS.items():
        module = importlib.import_module(module_name)
        for name in names:
            original = getattr(module, name)
            wrapped = on_device(original, device)
            # Rebind the name wherever it was imported (kernel modules and test modules).
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith(("kernels.", "tests.")) and \
                        getattr(other, name, None) is original:
                    monkeypatch.setattr(other, name, wrapped)
    yield
