"""`tandem plan` end to end in a subprocess, its topology read back by deploy/topology.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from deploy.topology import load_topology
from planner.topology_toml import topology_toml
from planner.trace import LengthDist, generate, save
from tests.planner.conftest import make_profile

ROOT = Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_plan_recommends_and_writes_a_topology_tandem_launch_reads(tmp_path):
    make_profile().save(tmp_path / "profile.json")
    out = tmp_path / "cluster.toml"
    result = plan("--profile", str(tmp_path / "profile.json"), "--rate", "30", "--requests", "600",
                  "--prompt-len", "uniform:32:600", "--output-len", "uniform:2:40",
                  "--slo-ttft-p99", "0.5", "--slo-tpot-p99", "0.06", "--token-budgets", "256,512",
                  "--max-batches", "8,32", "--max-workers", "12", "--write-topology", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"recommended: (\d+) prefill \+ (\d+) decode workers .*token budget (\d+), "
                      r"decode batch cap (\d+)", result.stdout)
    assert found, result.stdout
    prefill, decode, budget, batch = map(int, found.groups())
    assert "predicted: TTFT p50" in result.stdout and "meets" in result.stdout
    topology = load_topology(out)
    assert topology.expected_workers() == {"prefill": prefill, "decode": decode}
    assert topology.chunk_size == budget
    assert all(w.args == ("--max-num-seqs", str(batch)) for w in topology.workers if w.role == "decode")


def test_plan_reads_a_trace_and_reports_a_bad_one(tmp_path):
    make_profile().save(tmp_path / "profile.json")
    trace = tmp_path / "t.jsonl"
    save(generate(5.0, 200, LengthDist.parse("100"), LengthDist.parse("10"), seed=1), trace)
    args = ["--profile", str(tmp_path / "profile.json"), "--slo-ttft-p99", "2", "--slo-tpot-p99", "0.2",
            "--token-budgets", "512", "--max-batches", "16"]
    result = plan("--trace", str(trace), *args)
    assert result.returncode == 0 and "recommended: 1 prefill + 1 decode" in result.stdout, result.stdout + result.stderr
    trace.write_text(trace.read_text() + "oops\n")
    result = plan("--trace", str(trace), *args)
    assert result.returncode == 2 and f"{trace}:201: not JSON" in result.stderr


def test_a_cluster_too_big_for_one_hosts_ports_gets_a_host_per_worker(tmp_path):
    path = tmp_path / "big.toml"
    path.write_text(topology_toml(model="smollm2", prefill=3000, decode=7000, token_budget=1024, max_batch=128))
    topology = load_topology(path)
    assert topology.expected_workers() == {"prefill": 3000, "decode": 7000}
    assert len({w.host.name for w in topology.workers}) == 10000


def test_plan_sizes_for_a_worker_death_and_refuses_a_bad_one(tmp_path):
    make_profile().save(tmp_path / "profile.json")
    args = ["--profile", str(tmp_path / "profile.json"), "--rate", "15", "--requests", "300",
            "--prompt-len", "uniform:32:400", "--output-len", "uniform:2:30", "--slo-ttft-p99", "2",
            "--slo-tpot-p99", "0.2", "--token-budgets", "512", "--max-batches", "32", "--max-workers", "20"]
    result = plan(*args, "--fail", "prefill:0@5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failures: prefill worker 0 at 5 s, not restarted" in result.stdout
    assert re.search(r"\blost\b", result.stdout) and "moves after the failures, none lost" in result.stdout
    found = re.search(r"recommended: (\d+) prefill", result.stdout)
    assert found and int(found.group(1)) >= 2, result.stdout  # one prefill worker loses requests
    result = plan(*args, "--fail", "decode:x@5")
    assert result.returncode == 2 and "bad failure 'decode:x@5'" in result.stderr
    # A frozen worker: the same death, noticed at the heartbeat deadline.
    result = plan(*args, "--freeze", "prefill:0@5+10", "--heartbeat-deadline", "2.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("failures: prefill worker 0 frozen at 5 s, noticed 2.5 s later, back after 10 s"
            in result.stdout)
    # Thawed before the deadline: it resumes, nothing moves.
    result = plan(*args, "--freeze", "prefill:0@5+1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("failures: prefill worker 0 frozen at 5 s, thawed 1 s later, before its 3 s deadline "
            "(resumes)" in result.stdout)
    assert "; 0 moves after the failures, none lost" in result.stdout
    result = plan(*args, "--freeze", "prefill:0@5+0")
    assert result.returncode == 2 and "a freeze that thaws must last > 0 s" in result.stderr
    result = plan(*args, "--freeze", "prefill:0@5", "--heartbeat-deadline", "0")
    assert result.returncode == 2 and "--heartbeat-deadline must be a time > 0" in result.stderr
