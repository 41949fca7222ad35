"""benchmarks.bench_engine_peer: tandem's real prefill and decode children on a tiny Q4_1 model
beside a stand-in llama-bench (a script that prints llama-bench's JSON and logs its
arguments), the ratios it prints, and its errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_engine_peer import report, verdict
from reliability.model_factory import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

# llama-bench -o json's shape (the fields the benchmark reads, and a few it does not): one row
# per thread count for the test asked for (pp: 100 x threads tok/s, tg: 10 x threads), and a
# row of another test the benchmark must skip. Omits the threads listed in FAKE_OMIT.
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
p, n = int(opt["-p"]), int(opt["-n"])
rows = [{{"build_commit": "fake123", "n_threads": int(t), "n_prompt": p, "n_gen": n, "n_depth": int(opt["-d"]),
          "avg_ts": (100.0 if n == 0 else 10.0) * int(t), "stddev_ts": 0.0}}
        for t in opt["-t"].split(",") if t not in omit]
rows.append({{"build_commit": "fake123", "n_threads": 1, "n_prompt": 999, "n_gen": 7, "avg_ts": 9999.0}})
print(json.dumps(rows))
"""
ROW = re.compile(r"\s+(\d+)\s+([\d.]+) / ([\d.]+)\s+([\d.]+) / ([\d.]+)\s+([\d.]+)x \(([\d.]+)-([\d.]+)\)"
                 r"\s+(met|short of) 1x(.*)")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_peer")
    fake = root / "llama-bench"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    model = make_tiny_gguf(root / "tiny-q4_1.gguf", ggml_type="Q4_1").path
    return root, fake, model


def run(setup, *extra, env=None):
    root, fake, model = setup
    log = root / "calls.log"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_engine_peer", "--llama-bench", str(fake), str(model),
           "--prompt-len", "24", "--context", "16", "--decode-steps", "4", "--batches", "1,3", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "FAKE_LOG": str(log), **(env or {})})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return out, calls


def check_ratio(g, peer_each: float) -> float:
    """g: ROW's groups after the thread count. The ratio of the printed medians (of two: their
    mean) and the printed range of each round's pair; returns tandem's median."""
    peer, ours = [float(g[0]), float(g[1])], [float(g[2]), float(g[3])]
    assert peer == [peer_each, peer_each]  # the decoy row was not taken
    assert all(v > 0 for v in ours)
    ratio = (sum(ours) / 2) / peer_each
    assert float(g[4]) == pytest.approx(ratio, abs=0.011)
    assert [float(g[5]), float(g[6])] == pytest.approx(sorted(v / peer_each for v in ours), abs=0.011)
    assert g[7] == ("met" if float(g[4]) >= 1.0 else "short of")
    return sum(ours) / 2


def test_each_round_runs_both_sides_and_the_ratios_come_from_the_printed_figures(setup):
    out, calls = run(setup, "--rounds", "2", "--threads", "1,2")
    assert out.returncode == 0, out.stdout + out.stderr
    # Two llama-bench calls per round: the prompt (pp, no depth) and decode (tg at tandem's depth).
    tests = [tuple(dict(zip(a[::2], a[1::2]))[k] for k in ("-t", "-p", "-n", "-d", "-o")) for a in calls]
    assert tests == [("1,2", "24", "0", "0", "json"), ("1,2", "0", "4", "16", "json")] * 2
    # tandem's children: per round and thread count, one prompt-only pass and one decode run.
    assert out.stderr.count("bench_engine: ") == 8
    assert "copy bandwidth:" in out.stdout and "build fake123" in out.stdout
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "llama.cpp pp" in line)
    pp = [ROW.match(line) for line in lines[header + 1:header + 3]]
    tg_header = lines.index(next(line for line in lines if "llama.cpp tg" in line))
    tg = [ROW.match(line) for line in lines[tg_header + 1:tg_header + 3]]
    assert all(pp) and all(tg), out.stdout
    for m in pp:
        t = int(m.group(1))
        check_ratio(m.groups()[1:], 100.0 * t)
        # No batch columns on the prompt's rows: the format `auto` resolved to for this tiny Q4_1
        # file at this thread count.
        assert m.group(10).strip() in ("fp32", "int4", "bf16"), m.group(10)
    for m in tg:
        t = int(m.group(1))
        b1 = check_ratio(m.groups()[1:], 10.0 * t)
        # The batch's ratio, with no verdict: the 5x bar is the for a batch of 8, not 3.
        big = re.match(r"\s+([\d.]+) / ([\d.]+)\s+([\d.]+)x\s+-$", m.group(10))
        assert big, m.group(10)
        b3 = (float(big.group(1)) + float(big.group(2))) / 2
        assert float(big.group(3)) == pytest.approx(b3 / b1, abs=0.011)


def test_prompt_len_zero_times_decode_only(setup):
    out, calls = run(setup, "--rounds", "1", "--threads", "1", "--prompt-len", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert [dict(zip(a[::2], a[1::2]))["-p"] for a in calls] == ["0"]  # tg only
    assert "llama.cpp pp" not in out.stdout and "llama.cpp tg" in out.stdout
    assert out.stderr.count("bench_engine: ") == 1


def test_report_takes_medians_and_the_range_of_each_rounds_pair():
    rounds = [{"peer_tg": {1: 10.0}, "tandem": {1: {1: 12.0, 8: 60.0}}},
              {"peer_tg": {1: 20.0}, "tandem": {1: {1: 18.0, 8: 90.0}}},
              {"peer_tg": {1: 16.0}, "tandem": {1: {1: 8.0, 8: 20.0}}}]
    (line,) = report(Path("m.gguf"), rounds, [1], [1, 8])[2:]
    # medians: peer 16, b=1 12 -> 0.75x; pairs 1.2, 0.9, 0.5; b=8 median 60 / 12 = 5x
    assert "0.75x (0.50-1.20)" in line and "short of 1x" in line
    assert "5.00x" in line and "met 5x" in line
    for r, pp, ours in zip(rounds, (100.0, 120.0, 80.0), (150.0, 90.0, 130.0)):
        r["peer_pp"], r["prefill"] = {1: pp}, {1: (ours, "bf16")}
    lines = report(Path("m.gguf"), rounds, [1], [1, 8])
    # medians 100 and 130 -> 1.30x; pairs 1.5, 0.75, 1.625
    assert "1.30x (0.75-1.62)" in lines[2] and "met 1x" in lines[2] and lines[2].endswith("bf16")
    # The verdict follows the ratio as printed: 0.996 prints 1.00x, so it meets the bar.
    assert verdict(0.996, 1.0) == "met 1x" and verdict(0.994, 1.0) == "short of 1x"


@pytest.mark.parametrize("extra, env, message", [
    ((), {"FAKE_OMIT": "2"}, "no pp24 row for threads [2]"),
    (("--prompt-len", "0"), {"FAKE_OMIT": "2"}, "no tg4 row for threads [2]"),
    ((), {"FAKE_FAIL": "1"}, "exited with 3: error: failed to load model"),
    (("--batches", "8,1"), {}, "--batches must start at 1"),
    (("--batches", "1,8,3"), {}, "and ascend"),
    (("--prompt-len", "600"), {}, "at most 512"),
    (("--threads", "1,1"), {}, "--threads: distinct"),
    (("--rounds", "0"), {}, "must be >= 1"),
])
def test_bad_peers_and_options_end_with_a_clear_error(setup, extra, env, message):
    out, _ = run(setup, "--rounds", "1", "--threads", "1,2", *extra, env=env)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_an_unknown_model_or_a_missing_peer_is_named(setup, tmp_path):
    root, fake, model = setup
    for args, message in (([str(fake), str(tmp_path / "absent.gguf")], "absent.gguf"),
                          ([str(tmp_path / "no-bench"), str(model)], "not an executable")):
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_engine_peer", "--llama-bench", *args],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_file_tandem_cannot_load_ends_with_a_line_naming_it(setup, tmp_path):
    """The peer answers (the stand-in ignores the file), tandem's child refuses it: the child's
    own error, then one line naming the model, no traceback."""
    root, fake, _ = setup
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"junk")
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_engine_peer", "--llama-bench", str(fake),
                          str(bad), "--rounds", "1", "--threads", "1", "--prompt-len", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "FAKE_LOG": str(tmp_path / "calls.log")})
    assert out.returncode == 1
    assert "child failed on not-a-model.gguf at 1 thread(s)" in out.stderr, out.stderr
    assert "CalledProcessError" not in out.stderr


def test_bench_engine_times_a_prefill_workers_copy_only_when_asked(setup):
    """--prompt-only resolves `auto` as the prefill worker does and runs no decode; `auto`
    without it is refused (it is no decode format)."""
    _, _, model = setup
    base = [sys.executable, "-m", "benchmarks.bench_engine", str(model), "--formats", "auto", "--one-level",
            "--json", "--batches", "1", "--prompt-len", "16", "--repeats", "1"]
    out = subprocess.run(base + ["--prompt-only"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout.strip().splitlines()[-1])[0]["rows"]
    from engine.format_choice import choose_on_this_host
    from engine.loaders import load_model

    loaded = load_model(model)  # the worker's own resolution, in this process (bf16's speed: remembered)
    assert row["format"] == choose_on_this_host(loaded.config, loaded.weights).format
    assert row["decode"] == [] and row["prefill_tok_s"] > 0
    bad = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "add --prompt-only" in bad.stderr
