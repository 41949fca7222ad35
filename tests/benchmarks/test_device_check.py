"""benchmarks/device_check.py end to end with --device cpu: every stage at its CPU sizes, over a
tiny model, and the JSON report's schema (documented in the module docstring)."""

from __future__ import annotations

import json

import pytest

from benchmarks import device_check
from reliability.model_factory import make_tiny_hf_model


def numbers(obj: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(obj[key], (int, float)) and obj[key] > 0, (key, obj[key])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


def test_cpu_run_writes_every_figure(model_dir, tmp_path, capsys):
    import kvtransfer

    out = tmp_path / "check.json"
    code = device_check.main(["--out", str(out), "--device", "cpu", "--model", str(model_dir),
                              "--formats", "fp32,w8a8", "--kernel-filter", "rms_norm"])
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert code == (0 if report["ok"] else 1) and report["ok"], json.dumps(report, indent=1)
    assert report["schema"] == "tandem.device_check/1" and report["device"] == "cpu"
    assert set(report["stages"]) == {"kernels", "bench", "serve"}
    numbers(report, "total_s")

    kernels = report["stages"]["kernels"]
    assert kernels["status"] == "passed" and kernels["interpreter"] is True
    assert kernels["passed"] > 0 and kernels["failed"] == kernels["errors"] == 0
    assert kernels["files"] == list(device_check.KERNEL_TESTS)

    bench = report["stages"]["bench"]
    assert bench["status"] == "passed"
    numbers(bench, "bf16_gemm_peak_tflops", "hbm_copy_gb_s", "prompt_len", "context", "elapsed_s")
    numbers(bench["w8a8_vs_bf16_gemm"], "m", "n", "k", "bf16_s", "w8a8_s", "speedup")
    assert [r["format"] for r in bench["formats"]] == ["fp32", "w8a8"]
    for row in bench["formats"]:
        numbers(row, "prefill_tok_s", "prefill_tflops", "prefill_fraction_of_bf16_peak", "weight_bytes")
        assert [d["batch"] for d in row["decode"]] == [1, 2]
        for d in row["decode"]:
            numbers(d, "step_s", "tok_s", "gb_s", "fraction_of_hbm")

    serve = report["stages"]["serve"]
    assert serve["kv_backend"] == "dist"
    if "dist" in kvtransfer.backends():
        assert serve["status"] == "passed" and serve["eval_count"] >= 1, serve
    else:
        assert serve == {"status": "skipped", "kv_backend": "dist", "reason": "backend dist not available",
                         "elapsed_s": serve["elapsed_s"]}


def test_bad_stage_and_device_fail_at_start_up(tmp_path, monkeypatch):
    import torch

    with pytest.raises(SystemExit):
        device_check.main(["--out", str(tmp_path / "x.json"), "--device", "cpu", "--stages", "kernels,gpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        device_check.main(["--out", str(tmp_path / "x.json"), "--device", "cuda"])
    assert not (tmp_path / "x.json").exists()
