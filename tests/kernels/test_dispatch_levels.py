"""The quantization and default-model tests again, at every lower aten dispatch level this host
supports (ATEN_CPU_CAPABILITY picks aten's level and, through kernels/native.py, the native
kernels' build), so an AVX-512 host also proves the AVX2 and portable paths that other hosts
of this machine kind run. Each level runs in a fresh interpreter: aten reads the variable once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native

TESTS = Path(__file__).resolve().parents[1]
KERNEL_TESTS = ["kernels/test_native_linear.py", "kernels/test_linear_kernels.py",
                "kernels/test_native_attention.py", "kernels/test_native_elementwise.py",
                "kernels/test_native_threads.py"]
MODEL_TESTS = ["engine/test_default_model.py"]
# Of the default-model tests, those whose verdict rests on the kernels: the fp32 forward against
# llama.cpp's greedy tokens, and the decode formats' quality and answers. The transformers
# oracle (the model code, whatever the level), the CLI and the text stream are left to the main
# run: at this level they added minutes of the suite and no kernel.
MODEL_SELECTION = "llama_cpp or decode_formats or capital_of_france"
# The portable level runs the kernel tests only: its aten matmuls are several times slower and
# the model tests would add minutes without covering another kernel.
PLAN = {"avx2": (KERNEL_TESTS + MODEL_TESTS, MODEL_SELECTION), "default": (KERNEL_TESTS, None)}

LOWER = [lvl for lvl in native.LEVELS[: native.LEVELS.index(native.dispatch_level())]]


def test_the_host_level_is_known():
    assert native.dispatch_level() in native.LEVELS


@pytest.mark.parametrize("level", [lvl for lvl in ("avx2", "default") if lvl in LOWER] or
                         [pytest.param("none", marks=pytest.mark.skip(
                             reason="this host's own level is the lowest; the main run covers it"))])
def test_suite_passes_at_lower_dispatch_level(level, default_gguf):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
    plan, selection = PLAN[level]
    files = [str(TESTS / f) for f in plan]
    # -k applies to every file: each kernel test name is kept by prefixing the kernel files'
    # own names (pytest matches -k against the node id's file name too).
    select = (["-k", " or ".join([f"{Path(f).stem}" for f in KERNEL_TESTS] + [f"({selection})"])]
              if selection else [])
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().lower() == level, probe.stdout + probe.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select, *files],
                         env=env, capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and " failed" not in out.stdout, tail


@pytest.mark.parametrize("vnni,env,want", [(True, None, "avx512vnni"), (False, None, "avx512"),
                                           (True, "avx512", "avx512")])
def test_vnni_builds_run_where_the_cpu_has_vnni_unless_aten_s_level_is_set(monkeypatch, vnni, env, want):
    """aten has no VNNI level: the native kernels take the VNNI build on an AVX-512 CPU that
    reports avx512_vnni, and an explicit ATEN_CPU_CAPABILITY=avx512 means the plain build, so a
    VNNI host tests both (and the x86 check comes first: other CPUs run the portable build)."""
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(native, "_has_cpu_flag", lambda flag: vnni and flag == "avx512_vnni")
    if env is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", env)
    assert native.dispatch_level() == want


def test_a_child_process_is_sent_to_a_level_through_aten_s_variable_or_none_for_vnni():
    base = {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx2"}
    assert native.level_env("avx512", base) == {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "avx512"}
    assert native.level_env("avx512vnni", base) == {"PATH": "/bin"}
    with pytest.raises(ValueError, match="unknown native level"):
        native.level_env("avx1024", base)
