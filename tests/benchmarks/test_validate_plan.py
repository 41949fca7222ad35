"""benchmarks.validate_plan's saved runs: written once, simulated again without a cluster."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.validate_plan import Run, load_runs, main, save_runs, simulated
from tests.planner.conftest import make_profile


def _run() -> Run:
    # 12 requests of 8 tokens: TTFT 40..95 ms, token gaps of 20 ms and, for the last, one of 60.
    requests = [(0.1 * i, 100 + 20 * i, 8, 0.04 + 0.005 * i, [0.02] * 6 + [0.06 if i == 11 else 0.02])
                for i in range(12)]
    return Run("1:2:5:12", 2, 0.03, requests, (0.5, 0.7), (1.01, 0.98), 0.01)


def test_a_saved_run_replays_to_the_same_table(tmp_path, capsys):
    profile = make_profile()
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    run = _run()
    save_runs(tmp_path / "runs.json", [run], profile)
    assert load_runs(tmp_path / "runs.json") == [run]
    assert run.longest_gap_s == 0.06 and run.measured["TTFT p50"] == pytest.approx(0.07)
    assert [(r.arrival_s, r.prompt_tokens) for r in run.trace][:2] == [(0.0, 100), (0.1, 120)]
    main(["--profile", str(profile_path), "--replay", str(tmp_path / "runs.json")])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("1:2:5:12")]
    assert [r[7] for r in rows] == ["own", "shared", "even"]
    sims = simulated(run, profile)
    for row in rows:
        # TTFT p50 cells: measured, simulated, ratio (ms).
        meas, sim, ratio = (float(x) for x in row[8:11])
        assert meas == pytest.approx(70.0)
        assert sim == pytest.approx(1e3 * sims[row[7]]["TTFT p50"], abs=0.05)
        assert ratio == pytest.approx(sim / meas, abs=0.01)
    # Three workers on two cores are slower than three with a core each, either way shared.
    assert sims["own"]["TTFT p99"] <= min(sims["shared"]["TTFT p99"], sims["even"]["TTFT p99"])


def test_unmeasured_figures_are_saved_as_null(tmp_path):
    """No /proc/stat (steal NaN), no solo request answered (NaN) or one simulated as free
    (inf): strict JSON, NaN on load."""
    run = _run()
    unmeasured = Run(run.spec, run.cores, run.background, run.requests, run.load,
                     (math.inf, math.nan), math.nan)
    save_runs(tmp_path / "runs.json", [unmeasured], make_profile())
    saved = json.loads((tmp_path / "runs.json").read_text())["runs"][0]
    assert saved["steal_s"] is None and saved["solo"] == [None, None]
    (back,) = load_runs(tmp_path / "runs.json")
    assert math.isnan(back.steal_s) and all(map(math.isnan, back.solo))
    assert back.requests == run.requests


def test_replay_refuses_another_file(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema": "tandem-cost-profile/1"}))
    with pytest.raises(SystemExit, match="not a --save file"):
        load_runs(tmp_path / "x.json")
