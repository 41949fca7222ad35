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
    with pytest.raises(SystemExit, match="No such file"):
        load_runs(tmp_path / "missing.json")
    (tmp_path / "torn.json").write_text('{"schema": ')
    with pytest.raises(SystemExit, match="not JSON"):
        load_runs(tmp_path / "torn.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SystemExit, match="not a --save file"):
        load_runs(tmp_path / "list.json")
    (tmp_path / "shape.json").write_text(json.dumps({"schema": "tandem-validate-runs/1", "runs": [{"spec": "1:1:1:1"}]}))
    with pytest.raises(SystemExit, match="unknown shape"):
        load_runs(tmp_path / "shape.json")


def _overheads(p) -> tuple:
    return p.coordinator_overhead_s, p.prefill_pass_overhead_s, p.decode_step_overhead_s


def _solos(served, prompts=(60, 150, 240, 330, 420)) -> list:
    """Requests served alone as a cluster whose costs are exactly `served` would serve them."""
    from benchmarks.bench_modes import Sample
    from benchmarks.validate_plan import BUDGET, alone

    out = []
    for prompt in prompts:
        s = Sample("short", 0.0, [], 32, prompt, served.prefill_alone_s(prompt, BUDGET))
        t = alone(s, served)
        out.append(Sample("short", t.ttft_s, [t.tpot_s] * 31, 32, prompt, s.prefill_worker_s))
    return out


def test_serving_overheads_are_recovered_over_the_engine_s_costs():
    from dataclasses import replace

    from benchmarks.validate_plan import serving_overheads

    engine = make_profile(coordinator_overhead_s=0.0)
    served = replace(engine, coordinator_overhead_s=0.006, prefill_pass_overhead_s=0.02,
                     decode_step_overhead_s=0.001)
    solos = _solos(served)
    got = serving_overheads(engine, solos)
    assert (got.coordinator_s, got.prefill_pass_s, got.decode_step_s) == pytest.approx((0.006, 0.02, 0.001))
    assert got.requests == len(solos)
    # Measured over the engine's costs: a profile's own overheads do not count twice.
    stale = replace(engine, coordinator_overhead_s=0.05, prefill_pass_overhead_s=0.03, decode_step_overhead_s=0.004)
    assert serving_overheads(stale, solos) == got
    assert _overheads(got.applied_to(stale)) == pytest.approx(_overheads(served))
    assert replace(got.applied_to(stale), **dict(zip(("coordinator_overhead_s", "prefill_pass_overhead_s",
                                                      "decode_step_overhead_s"), _overheads(stale)))) == stale
    # A pass overhead needs the prefill worker's own times.
    with pytest.raises(ValueError, match="prefill_worker_s"):
        serving_overheads(engine, [replace(s, prefill_worker_s=None) for s in solos])


def test_the_calibrated_rows_use_the_overheads_of_the_run_s_own_solo_requests(tmp_path, capsys):
    from dataclasses import replace

    from benchmarks.validate_plan import calibrated

    profile = make_profile()  # measured long ago: its overheads are not the run's
    served = replace(profile, coordinator_overhead_s=0.006, prefill_pass_overhead_s=0.02,
                     decode_step_overhead_s=0.001)
    run = replace(_run(), solos=_solos(served))
    assert _overheads(calibrated(run, profile)) == pytest.approx(_overheads(served))
    assert calibrated(run, profile).prefill_base_s == profile.prefill_base_s  # the engine's stay
    assert calibrated(_run(), profile) is None  # kept no solo requests
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    save_runs(tmp_path / "runs.json", [run], profile)
    assert load_runs(tmp_path / "runs.json") == [run]
    main(["--profile", str(profile_path), "--replay", str(tmp_path / "runs.json")])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("1:2:5:12")]
    assert [r[7] for r in rows] == ["own", "shared", "even", "calibrated"]
    # The solo ratios are recomputed against the replay's profile from the kept requests.
    from benchmarks.validate_plan import alone, solo_ratios
    ttft, tpot = solo_ratios([(s, alone(s, profile)) for s in run.solos])
    assert rows[0][4] == f"{ttft:4.2f}/{tpot:<4.2f}" != "1.01/0.98"
    # A solo request that did not report its prefill worker's time round-trips as None.
    unreported = replace(run, solos=[replace(run.solos[0], prefill_worker_s=None), *run.solos[1:]])
    save_runs(tmp_path / "none.json", [unreported], profile)
    assert load_runs(tmp_path / "none.json") == [unreported]
    # A file saved before the solo requests were kept still loads (no calibrated row).
    data = json.loads((tmp_path / "runs.json").read_text())
    del data["runs"][0]["solos"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_runs(tmp_path / "old.json")[0].solos == []
