"""The two builds of the dot-chain count (csrc/simd.h dot_chains; kernels/native.py sets
TANDEM_SPLIT_ZMM on AMD Zen 4) give the same bits: the int4 kernels (int16 and int8
activations, Q4_1 and Q4_K blocks), the int8 kernel and the Q6_K kernel at 1 to 9 rows, this
process's build against a child's built the other way. Whichever build the host takes by
itself, the test proves the other one too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import native, quant_int4, quant_int8, quant_q6_k
from tests.kernels.test_native_kquant import kquant

ROOT = Path(__file__).resolve().parents[2]
ROWS = (1, 2, 3, 4, 5, 8, 9)
CPU = torch.device("cpu")


def outputs() -> dict[str, torch.Tensor]:
    """Every kernel whose chain count the build changes, on fixed inputs (the same in any
    process: seeded generators only)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 2048, generator=g)
    packs = {
        "q4_1": quant_int4.pack(w, None, CPU, "q4_1"),
        "q4_1a8": quant_int4.pack(w, None, CPU, "q4_1a8"),
        "q4_k": quant_int4.pack(kquant("Q4_K", 48, 2048, 1), None, CPU, "q4_k"),
        "q4_ka8": quant_int4.pack(kquant("Q4_K", 48, 2048, 1), None, CPU, "q4_ka8"),
        "int8": quant_int8.pack(w, None, CPU, "native"),
    }
    q6 = quant_q6_k.pack(kquant("Q6_K", 48, 2048, 2), None, "q6_k")
    out = {}
    for m in ROWS:
        x = torch.randn(m, 2048, generator=g)
        for name, packed in packs.items():
            out[f"{name}/{m}"] = (quant_int4.int4_linear_native(x, packed) if name != "int8"
                                  else quant_int8.int8_linear_native(x, packed))
        out[f"q6_k/{m}"] = quant_q6_k.q6k_linear_native(x, q6)
    return out


def test_the_split_build_follows_the_cpu_and_the_override(monkeypatch):
    monkeypatch.setenv("TANDEM_SPLIT_ZMM", "1")
    assert native.split_zmm()
    monkeypatch.setenv("TANDEM_SPLIT_ZMM", "0")
    assert not native.split_zmm()
    monkeypatch.delenv("TANDEM_SPLIT_ZMM")
    fields = {name: native._cpu_field(name) for name in ("vendor_id", "cpu family")}
    zen4 = fields == {"vendor_id": "AuthenticAMD", "cpu family": "25"} and native._has_cpu_flag("avx512f")
    assert native.split_zmm() == zen4


@pytest.mark.skipif(not native.available(), reason="no native kernels on this host (no compiler)")
def test_both_chain_counts_give_the_same_bits(tmp_path):
    ours = outputs()
    assert {k.split("/")[0] for k in ours} == {"q4_1", "q4_1a8", "q4_k", "q4_ka8", "int8", "q6_k"}
    other = "0" if native.split_zmm() else "1"
    saved = tmp_path / "other.pt"
    env = {**os.environ, "TANDEM_SPLIT_ZMM": other, "TANDEM_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    code = ("import sys, torch; sys.path.insert(0, sys.argv[2]); "
            "from tests.kernels.test_split_zmm import outputs; torch.save(outputs(), sys.argv[1])")
    run = subprocess.run([sys.executable, "-c", code, str(saved), str(ROOT)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    theirs = torch.load(saved)
    assert theirs.keys() == ours.keys()
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not differ, differ
