"""benchmarks.bench_decode_peer: tandem's real decode child on a tiny Q4_1 model beside a
stand-in llama-bench (a script that prints llama-bench's JSON and logs its arguments), the
ratios it prints, and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_decode_peer import report
from reliability.model_factory import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

# llama-bench -o json's shape (the fields the benchmark reads, and a few it does not): tg tok/s
# 10 x threads, and a pp row the benchmark must skip. Omits the threads listed in FAKE_OMIT.
FAKE = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_FAIL"):
    print("error: failed to load model", file=sys.stderr)
    sys.exit(3)
opt = dict(zip(args[::2], args[1::2]))
omit = os.environ.get("FAKE_OMIT", "").split(",")
rows = [{{"build_commit": "fake123", "n_threads": int(t), "n_prompt": 0, "n_gen": int(opt["-n"]),
          "n_depth": int(opt["-d"]), "avg_ts": 10.0 * int(t), "stddev_ts": 0.0}}
        for t in opt["-t"].split(",") if t not in omit]
rows.append({{"build_commit": "fake123", "n_threads": 1, "n_prompt": 512, "n_gen": 0, "avg_ts": 999.0}})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_peer")
    fake = root / "llama-bench"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    model = make_tiny_gguf(root / "tiny-q4_1.gguf", ggml_type="Q4_1").path
    return root, fake, model


def run(setup, *extra, env=None):
    root, fake, model = setup
    log = root / "calls.log"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_decode_peer", "--llama-bench", str(fake), str(model),
           "--context", "16", "--decode-steps", "4", "--batches", "1,3", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "FAKE_LOG": str(log), **(env or {})})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return out, calls


def test_each_round_runs_both_sides_and_the_ratios_come_from_the_printed_figures(setup):
    out, calls = run(setup, "--rounds", "2", "--threads", "1,2")
    assert out.returncode == 0, out.stdout + out.stderr
    # One llama-bench call per round, at the same depth, steps and threads as tandem's decode.
    assert len(calls) == 2
    for args in calls:
        opt = dict(zip(args[::2], args[1::2]))
        assert (opt["-t"], opt["-p"], opt["-n"], opt["-d"], opt["-o"]) == ("1,2", "0", "4", "16", "json")
    assert out.stderr.count("bench_engine: ") == 4  # tandem's child: 2 rounds x 2 thread counts
    assert "copy bandwidth:" in out.stdout and "build fake123" in out.stdout
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s+(\d+)\s+([\d.]+) / ([\d.]+)\s+([\d.]+) / ([\d.]+)\s+([\d.]+)x \(([\d.]+)-([\d.]+)\)"
                     r"\s+(met|short of) 1x\s+([\d.]+) / ([\d.]+)\s+([\d.]+)x\s+(met|short of) 5x", line)
        if m:
            rows[int(m.group(1))] = m.groups()[1:]
    assert sorted(rows) == [1, 2], out.stdout
    for t, g in rows.items():
        peer = [float(g[0]), float(g[1])]
        assert peer == [10.0 * t, 10.0 * t]  # the pp row was not taken for tg
        b1, b3 = [float(g[2]), float(g[3])], [float(g[8]), float(g[9])]
        assert all(v > 0 for v in b1 + b3)
        ratio = (sum(b1) / 2) / (10.0 * t)  # the median of two is their mean
        assert float(g[4]) == pytest.approx(ratio, abs=0.011)
        assert g[7] == ("met" if float(g[4]) >= 1.0 else "short of")
        pairs = sorted(v / (10.0 * t) for v in b1)
        assert [float(g[5]), float(g[6])] == pytest.approx(pairs, abs=0.011)
        assert float(g[10]) == pytest.approx((sum(b3) / 2) / (sum(b1) / 2), abs=0.011)
        assert g[11] == ("met" if float(g[10]) >= 5.0 else "short of")


def test_report_takes_medians_and_the_range_of_each_rounds_pair():
    rounds = [{"peer": {1: 10.0}, "tandem": {1: {1: 12.0, 8: 60.0}}},
              {"peer": {1: 20.0}, "tandem": {1: {1: 18.0, 8: 90.0}}},
              {"peer": {1: 16.0}, "tandem": {1: {1: 8.0, 8: 20.0}}}]
    (line,) = report(Path("m.gguf"), rounds, [1], [1, 8])[2:]
    # medians: peer 16, b=1 12 -> 0.75x; pairs 1.2, 0.9, 0.5; b=8 median 60 / 12 = 5x
    assert "0.75x (0.50-1.20)" in line and "short of 1x" in line
    assert "5.00x" in line and "met 5x" in line


@pytest.mark.parametrize("extra, env, message", [
    ((), {"FAKE_OMIT": "2"}, "no tg row for threads [2]"),
    ((), {"FAKE_FAIL": "1"}, "exited with 3: error: failed to load model"),
    (("--batches", "8,1"), {}, "--batches must start at 1"),
    (("--threads", "1,1"), {}, "--threads: distinct"),
    (("--rounds", "0"), {}, "must be >= 1"),
])
def test_bad_peers_and_options_end_with_a_clear_error(setup, extra, env, message):
    out, _ = run(setup, "--rounds", "1", "--threads", "1,2", *extra, env=env)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_an_unknown_model_or_a_missing_peer_is_named(setup, tmp_path):
    root, fake, _ = setup
    for args, message in (([str(fake), str(tmp_path / "absent.gguf")], "absent.gguf"),
                          ([str(tmp_path / "no-bench"), str(setup[2])], "not an executable")):
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_decode_peer", "--llama-bench", *args],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2 and message in out.stderr, out.stderr
