"""benchmarks.bench_engine end to end on the default model, with tiny settings: the parent starts
one child for the host's dispatch level and prints the copy bandwidth and a row per format and
batch with positive figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import native

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d+\.?\d*")


@pytest.mark.model
def test_bench_engine_prints_a_row_per_format_and_batch(default_gguf):
    level = native.dispatch_level()
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", str(default_gguf), "--formats", "int4",
           "--batches", "1,2", "--context", "32", "--decode-steps", "2", "--prompt-len", "32",
           "--repeats", "1", "--levels", level]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()

    copy = [line for line in lines if line.startswith("copy bandwidth:")]
    assert len(copy) == 1 and float(NUMBER.search(copy[0]).group()) > 0, out.stdout

    rows = [line.split() for line in lines if line.split()[:2] == [level, "int4"]]
    # level, format, prefill (first batch only), batch, tok/s, x b=1, weights MB, KV MB, GB/s, x copy
    assert [len(r) for r in rows] == [10, 9], out.stdout
    assert [r[-7] for r in rows] == ["1", "2"], out.stdout
    for r in rows:
        assert all(float(x) > 0 for x in r[2:]), r


@pytest.mark.model
def test_json_rows_carry_the_prefill_lengths_asked_for(default_gguf):
    # Through the parent, which passes --prefill-lens on to the level's child.
    import json

    level = native.dispatch_level()
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", str(default_gguf), "--formats", "int4",
           "--batches", "1", "--context", "16", "--decode-steps", "1", "--prompt-len", "16",
           "--repeats", "1", "--levels", level, "--json", "--prefill-lens", "8,40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])[0]["rows"]
    assert [n for n, _ in row["prefill_points"]] == [8, 40]  # 40: longer than --prompt-len
    assert all(s > 0 for _, s in row["prefill_points"])
    bad = subprocess.run(cmd[:-1] + ["8,0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--prefill-lens" in bad.stderr
