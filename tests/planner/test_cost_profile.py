"""The cost profile: fitted from bench_engine / bench_kvtransfer JSON, saved, loaded."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner.cost_profile import CostProfile, fit_profile
from tests.planner.conftest import make_profile

TRUE = make_profile(prefill_base_s=0.004, prefill_per_token_s=2e-4, prefill_per_pair_s=3e-8,
                    decode_base_s=0.015, decode_per_seq_s=5e-4, decode_per_ctx_token_s=2e-7,
                    kv_bytes_per_token=46080.0, transfer_bytes_per_s=2e9, transfer_latency_s=1e-3)


def bench_engine_json(p: CostProfile, prompt_len: int, context: int, batches=(1, 4, 16)) -> list[dict]:
    """What `bench_engine --json --one-level` prints, made from known costs."""
    def row(fmt: str) -> dict:
        prefill_s = p.prefill_pass_s(prompt_len, CostProfile.chunk_pairs(prompt_len, 0))
        return {"format": fmt, "prompt_len": prompt_len, "context": context,
                "prefill_tok_s": prompt_len / prefill_s, "weight_bytes": 1,
                "decode": [{"batch": b, "step_s": p.decode_step_s(b, b * context),
                            "kv_bytes": int(p.kv_bytes_per_token) * context * b} for b in batches]}
    return [{"level": "avx2", "model": "m", "rows": [row("w8a8"), row("int4")]}]


def kvtransfer_json(p: CostProfile) -> dict:
    gb_s = {str(t): t * p.kv_bytes_per_token / p.transfer_s(t) / 1e9 for t in (128, 512, 2048)}
    return {"layout": {"bytes_per_token": int(p.kv_bytes_per_token)}, "gb_s": {"zmq": gb_s, "shm": gb_s}}


def test_fit_recovers_the_costs_it_was_made_from():
    runs = [bench_engine_json(TRUE, n, c) for n, c in ((64, 128), (256, 512), (1024, 1024))]
    p = fit_profile(runs, kvtransfer_json(TRUE), prefill_format="w8a8", decode_format="int4")
    for name in ("prefill_base_s", "prefill_per_token_s", "prefill_per_pair_s", "decode_base_s",
                 "decode_per_seq_s", "decode_per_ctx_token_s", "transfer_bytes_per_s",
                 "transfer_latency_s", "kv_bytes_per_token"):
        assert getattr(p, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_the_prefill_fit_uses_every_length_a_row_timed():
    # One row per decode point, as profile_host runs them, each with more single-pass prompt
    # lengths (bench_engine --prefill-lens). Its own prompt_len points alone would pin the
    # three prefill coefficients with no residual; the extra points, noisy alike, average.
    noisy = {16: 1.08, 64: 0.95, 128: 1.04, 256: 0.97, 384: 1.03, 512: 0.96}

    def runs(extra: bool) -> list:
        out = []
        for n, c, more in ((64, 128, (16, 128)), (256, 512, (384,)), (512, 1024, ())):
            run = bench_engine_json(TRUE, n, c)
            for row in run[0]["rows"]:
                row["prefill_tok_s"] /= noisy[n]
                if extra:
                    row["prefill_points"] = [[m, TRUE.prefill_pass_s(m, CostProfile.chunk_pairs(m, 0)) * noisy[m]]
                                             for m in more]
            out.append(run)
        return out

    def error(p: CostProfile) -> float:  # worst relative error over the token budget
        return max(abs(p.prefill_alone_s(n, 512) / TRUE.prefill_alone_s(n, 512) - 1) for n in range(16, 513, 16))

    exact = fit_profile(runs(False), None, prefill_format="w8a8", decode_format="int4")
    more = fit_profile(runs(True), None, prefill_format="w8a8", decode_format="int4")
    assert error(more) < error(exact)


def test_fit_never_gives_a_negative_cost():
    # Decode steps that get cheaper with context (noise): the context term is dropped, not < 0.
    runs = [[{"level": "x", "model": "m", "rows": [
        {"format": "f", "prompt_len": n, "context": c, "prefill_tok_s": n / (0.01 + 1e-4 * n),
         "weight_bytes": 1, "decode": [{"batch": b, "step_s": 0.02 + 1e-3 * b - 1e-9 * b * c, "kv_bytes": b * c}
                                       for b in (1, 8)]}]}] for n, c in ((64, 64), (512, 4096))]
    p = fit_profile(runs, None)
    assert p.decode_per_ctx_token_s == 0.0 and p.decode_base_s > 0 and p.decode_per_seq_s > 0
    assert "transfer not measured" in p.source


def test_profile_round_trips_json(tmp_path):
    path = tmp_path / "profile.json"
    TRUE.save(path)
    assert CostProfile.load(path) == TRUE
    assert json.loads(path.read_text())["schema"] == "tandem-cost-profile/1"


def test_load_refuses_other_files_and_bad_values(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="not a cost profile"):
        CostProfile.load(bad)
    bad.write_text(json.dumps({**TRUE.to_json(), "decode_base_s": -1.0}))
    with pytest.raises(ValueError, match="decode_base_s"):
        CostProfile.load(bad)
    bad.write_text(json.dumps({**TRUE.to_json(), "extra": 1}))
    with pytest.raises(ValueError, match="unknown fields"):
        CostProfile.load(bad)


def test_rows_without_their_lengths_are_refused():
    runs = [[{"level": "x", "model": "m", "rows": [{"format": "f", "prefill_tok_s": 1.0, "decode": []}]}]]
    with pytest.raises(ValueError, match="prompt_len"):
        fit_profile(runs, None)


def test_a_served_step_costs_the_engine_s_step_plus_its_overhead(tmp_path):
    served = replace(TRUE, decode_step_overhead_s=0.002)
    assert served.decode_step_s(4, 400) == pytest.approx(TRUE.decode_step_s(4, 400) + 0.002)
    _check_saved(tmp_path, served, "decode_step_overhead_s")


def _check_saved(tmp_path, served: CostProfile, field: str) -> None:
    """`served` round-trips its JSON, and a profile written before `field` existed still
    loads, with no overhead."""
    path = tmp_path / "served.json"
    served.save(path)
    assert CostProfile.load(path) == served
    old = {k: v for k, v in TRUE.to_json().items() if k != field}
    path.write_text(json.dumps(old))
    assert getattr(CostProfile.load(path), field) == 0.0


def test_a_served_pass_costs_the_engine_s_pass_plus_its_overhead(tmp_path):
    served = replace(TRUE, prefill_pass_overhead_s=0.04)
    pairs = CostProfile.chunk_pairs(300, 16)
    assert served.prefill_pass_s(300, pairs) == pytest.approx(TRUE.prefill_pass_s(300, pairs) + 0.04)
    # Alone, a prompt pays it once per pass: three passes of a 1,200-token prompt at 512.
    assert served.prefill_alone_s(1200, 512) == pytest.approx(TRUE.prefill_alone_s(1200, 512) + 3 * 0.04)
    assert TRUE.prefill_alone_s(1200, 512) == pytest.approx(
        TRUE.prefill_pass_s(512, CostProfile.chunk_pairs(512, 0))
        + TRUE.prefill_pass_s(512, CostProfile.chunk_pairs(512, 512))
        + TRUE.prefill_pass_s(176, CostProfile.chunk_pairs(176, 1024)))
    _check_saved(tmp_path, served, "prefill_pass_overhead_s")
    _check_saved(tmp_path, replace(TRUE, request_side_cpu_s=0.04), "request_side_cpu_s")
    with pytest.raises(ValueError, match="budget"):
        TRUE.prefill_alone_s(100, 0)
