"""The device check: one run on a GPU host that proves the Triton kernels, measures the engine
against the hardware's peaks, and serves a request disaggregated over torch.distributed.

    python -m benchmarks.device_check --out FILE [--device cuda|cuda:N|cpu] [--model smollm2]
                                  [--formats bf16,w8a8,int4] [--kernel-filter EXPR]
                                  [--stages kernels,bench,serve] [--budget-s 300]

Stages, in order, each bounded so that the whole run fits --budget-s (default 5 minutes):

kernels  pytest on the kernel test files (KERNEL_TESTS). On CUDA: TRITON_INTERPRET=0 and
         TANDEM_TEST_DEVICE=cuda, so every Triton launcher those tests call runs compiled on
         the GPU (tests/helpers/device_launchers.py); on the CPU: under the interpreter, as the suite
         runs. --kernel-filter is pytest's -k.
bench    the engine benchmark (benchmarks/bench_engine.py's bench_format) per format, beside peaks
         measured here: the bf16 GEMM peak (a square torch.matmul), the HBM bandwidth (a
         device-to-device copy), and W8A8 against bf16 on one large GEMM shape.
serve    `tandem serve`'s processes (deploy/local.py) with --kv-backend dist --device DEVICE,
         one prefill and one decode worker, and one /api/chat request checked (a non-empty
         reply of at least one token). "skipped" when the dist backend is not installed.

On --device cpu every size shrinks (tiny GEMMs, short prompts, gloo under the dist backend):
that is how tests/benchmarks/test_device_check.py runs the whole script on a CPU-only host.

Output: FILE gets one JSON object (also printed, one line, on stdout); the exit status is 0
when no stage failed. Schema "tandem.device_check/1":

    {"schema": "tandem.device_check/1", "device": "cuda:0", "device_name": str,
     "torch": str, "triton": str | null, "started": ISO-8601 UTC, "total_s": float, "ok": bool,
     "stages": {
       "kernels": {"status": S, "elapsed_s": float, "interpreter": bool, "files": [str],
                   "passed": int, "failed": int, "skipped": int, "errors": int, "tail": str},
       "bench":   {"status": S, "elapsed_s": float, "model": str,
                   "bf16_gemm_peak_tflops": float, "gemm_peak_n": int,
                   "hbm_copy_gb_s": float,
                   "w8a8_vs_bf16_gemm": {"m": int, "n": int, "k": int, "bf16_s": float,
                                         "w8a8_s": float, "speedup": float},
                   "prompt_len": int, "context": int,
                   "formats": [{"format": str, "prefill_tok_s": float, "prefill_tflops": float,
                                "prefill_fraction_of_bf16_peak": float, "weight_bytes": int,
                                "decode": [{"batch": int, "step_s": float, "tok_s": float,
                                            "gb_s": float, "fraction_of_hbm": float}]}]},
       "serve":   {"status": S, "elapsed_s": float, "kv_backend": "dist", "reply": str,
                   "eval_count": int}}}

S is "passed", "failed" (with "reason" when a timeout cut it short), "skipped" (with "reason")
or "error" (with "error": the exception, and "traceback");
a stage not asked for is absent. prefill_tflops counts 2 * (every projection's in x out) per
token plus causal attention (2 * 2 * layers * q_size * prompt_len / 2 per token); gb_s is
(weight bytes + the batch's KV bytes at `context`) / step time, fraction_of_hbm its share of
hbm_copy_gb_s (read+write bytes of the copy, the bandwidth a streaming read can reach).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ("tests/kernels/test_linear_kernels.py", "tests/kernels/test_attention_kernels.py",
                "tests/kernels/test_elementwise_kernels.py", "tests/kernels/test_kv_cache_write.py")
STAGES = ("kernels", "bench", "serve")
SCHEMA = "tandem.device_check/1"


class Sizes:
    """What each stage measures at: GPU sizes that fit the 5-minute budget, CPU sizes that
    fit a test."""

    def __init__(self, cuda: bool) -> None:
        self.gemm_peak_n = 8192 if cuda else 256
        self.w8a8_mnk = (4096, 4096, 4096) if cuda else (128, 256, 256)
        self.copy_mbytes = 1024 if cuda else 32
        self.prompt_len = 1024 if cuda else 16
        self.context = 512 if cuda else 16
        self.batches = "1,8,32" if cuda else "1,2"
        self.decode_steps = 16 if cuda else 2
        self.repeats = 3 if cuda else 1
        self.serve_timeout_s = 150.0 if cuda else 90.0


# ---- kernels ------------------------------------------------------------------------------------

def run_kernel_tests(device: str, filter_expr: str | None, timeout_s: float) -> dict:
    cuda = device.startswith("cuda")
    env = {**os.environ, "TRITON_INTERPRET": "0" if cuda else "1", "TANDEM_TEST_DEVICE": device,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # -v: one line per test, so a run cut short by the timeout still reports what it ran.
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *KERNEL_TESTS]
    if filter_expr:
        cmd += ["-k", filter_expr]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        text, code, timed_out = out.stdout + out.stderr, out.returncode, False
    except subprocess.TimeoutExpired as exc:
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                       for part in (exc.stdout, exc.stderr))
        code, timed_out = None, True
    counts = {key: 0 for key in ("passed", "failed", "skipped", "errors")}
    for word in re.findall(r"::\S+ (PASSED|FAILED|SKIPPED|ERROR)\b", text):
        counts[{"ERROR": "errors"}.get(word, word.lower())] += 1
    ok = code == 0 and counts["passed"] > 0
    result = {"status": "passed" if ok else "failed", "interpreter": not cuda, "files": list(KERNEL_TESTS),
              **counts, "tail": "\n".join(text.strip().splitlines()[-15:])}
    if timed_out:
        result["reason"] = f"timed out after {timeout_s:.0f} s"
    return result


# ---- bench --------------------------------------------------------------------------------------

def _best_s(fn, device, repeats: int = 5) -> float:
    from benchmarks.bench_engine import synchronize

    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bf16_gemm_peak_tflops(n: int, device) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / _best_s(lambda: a @ b, device) / 1e12


def w8a8_vs_bf16(m: int, n: int, k: int, device) -> dict:
    """One GEMM shape through the product's linear(): W8A8 (int8 x int8, per-token activation
    quantization included) against dense bf16."""
    import torch

    from kernels.linear import linear, pack_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    x = torch.randn(m, k, generator=gen).to(device)
    bf16, w8a8 = (pack_linear(w, None, fmt, device=device) for fmt in ("bf16", "w8a8"))
    bf16_s = _best_s(lambda: linear(x, bf16), device)
    w8a8_s = _best_s(lambda: linear(x, w8a8), device)
    return {"m": m, "n": n, "k": k, "bf16_s": bf16_s, "w8a8_s": w8a8_s, "speedup": bf16_s / w8a8_s}


def prefill_flops_per_token(model, prompt_len: int) -> float:
    cfg = model.config
    layer = model.layers[0]
    linear = sum(p.in_features * p.out_features for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    attention = 2 * 2 * cfg.q_size * prompt_len / 2  # QK^T and PV over half the prompt on average
    return cfg.num_layers * (2 * linear + attention)


def run_bench(model_path: Path, formats: list[str], device: str, sizes: Sizes) -> dict:
    import gc

    from benchmarks.bench_engine import bench_format, copy_bandwidth
    from engine.loaders import load_model
    from engine.models import model_class

    peak = bf16_gemm_peak_tflops(sizes.gemm_peak_n, device)
    hbm = copy_bandwidth(sizes.copy_mbytes, 5, device)
    ratio = w8a8_vs_bf16(*sizes.w8a8_mnk, device)
    loaded = load_model(model_path)
    args = argparse.Namespace(batches=sizes.batches, prompt_len=sizes.prompt_len, context=sizes.context,
                              decode_steps=sizes.decode_steps, repeats=sizes.repeats, kv_dtype="fp32",
                              device=device, no_cuda_graphs=False)
    # Shapes only (the FLOP count), on the CPU: never the weights of the timed copy.
    shapes = model_class(loaded.config.architecture)(loaded.config, loaded.weights, "fp32")
    flops = prefill_flops_per_token(shapes, sizes.prompt_len)
    del shapes
    rows = []
    for fmt in formats:
        r = bench_format(loaded, fmt, args)
        gc.collect()
        tflops = r["prefill_tok_s"] * flops / 1e12
        decode = []
        for d in r["decode"]:
            gb_s = (r["weight_bytes"] + d["kv_bytes"]) / d["step_s"] / 1e9
            decode.append({"batch": d["batch"], "step_s": d["step_s"], "tok_s": d["batch"] / d["step_s"],
                           "gb_s": gb_s, "fraction_of_hbm": gb_s / hbm})
        rows.append({"format": fmt, "prefill_tok_s": r["prefill_tok_s"], "prefill_tflops": tflops,
                     "prefill_fraction_of_bf16_peak": tflops / peak, "weight_bytes": r["weight_bytes"],
                     "decode": decode})
    return {"status": "passed", "model": loaded.config.name, "bf16_gemm_peak_tflops": peak,
            "gemm_peak_n": sizes.gemm_peak_n, "hbm_copy_gb_s": hbm, "w8a8_vs_bf16_gemm": ratio,
            "prompt_len": sizes.prompt_len, "context": sizes.context, "formats": rows}


# ---- serve --------------------------------------------------------------------------------------

def run_serve(model_path: Path, device: str, timeout_s: float) -> dict:
    import kvtransfer
    from deploy.local import LocalCluster
    from deploy.process_plan import free_port, plan
    from deploy.local_topology import Topology
    from worker.config import KV_BACKENDS

    if "dist" not in kvtransfer.backends() or "dist" not in KV_BACKENDS:
        return {"status": "skipped", "kv_backend": "dist", "reason": "backend dist not available"}
    with tempfile.TemporaryDirectory(prefix="tandem-device-check-") as tmp:
        log_dir = Path(tmp)
        topology = Topology(model=str(model_path), model_path=model_path, log_dir=log_dir,
                            port=free_port(), prefill=1, decode=1, kv_backend="dist", device=device,
                            chunk_size=256, coordinator_args=("--model-name", "check"),
                            worker_args=("--kv-cache-gb", "0.25"))
        specs, ready = plan(topology)
        with LocalCluster(specs, ready, start_timeout_s=timeout_s) as cluster:
            cluster.out = lambda line: None
            cluster.start()
            body = json.dumps({"model": "check", "stream": False, "messages": [
                {"role": "user", "content": "Say hello."}],
                "options": {"num_predict": 8, "temperature": 0}}).encode()
            request = urllib.request.Request(ready.url + "/api/chat", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.loads(response.read())
    reply = answer.get("message", {}).get("content", "")
    tokens = int(answer.get("eval_count", 0))
    ok = tokens >= 1 and answer.get("done") is True
    return {"status": "passed" if ok else "failed", "kv_backend": "dist", "reply": reply,
            "eval_count": tokens}


# ---- the run ------------------------------------------------------------------------------------

def _stage(fn, *args) -> dict:
    t0 = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a stage's failure is a figure of the report
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=5)}
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def resolve_model(name: str) -> Path:
    if Path(name).exists():
        return Path(name)
    from common.model_store import default_store

    return default_store().resolve(name)


def run(args: argparse.Namespace) -> dict:
    import torch

    from engine.device import resolve_device
    from kernels._triton import HAS_TRITON, triton

    device = str(resolve_device(args.device).torch_device)
    cuda = device.startswith("cuda")
    sizes = Sizes(cuda)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stages {bad}; choose among {', '.join(STAGES)}")
    started = time.perf_counter()
    report = {"schema": SCHEMA, "device": device,
              "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__ if HAS_TRITON else None,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "stages": {}}
    model_path = resolve_model(args.model)
    # Budget: the kernel tests may take 40% of it; the serve stage gets what is left.
    if "kernels" in stages:
        report["stages"]["kernels"] = _stage(run_kernel_tests, device, args.kernel_filter,
                                             0.4 * args.budget_s)
    if "bench" in stages:
        report["stages"]["bench"] = _stage(run_bench, model_path, args.formats.split(","), device, sizes)
    if "serve" in stages:
        left = max(30.0, args.budget_s - (time.perf_counter() - started))
        report["stages"]["serve"] = _stage(run_serve, model_path, device, min(sizes.serve_timeout_s, left))
    report["total_s"] = time.perf_counter() - started
    report["ok"] = all(s["status"] in ("passed", "skipped") for s in report["stages"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where the JSON report goes")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--model", default="smollm2", help="model name, GGUF file or HF directory")
    p.add_argument("--formats", default="bf16,w8a8,int4", help="weight formats the bench stage runs")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated among " + ", ".join(STAGES))
    p.add_argument("--kernel-filter", help="pytest -k expression for the kernel tests")
    p.add_argument("--budget-s", type=float, default=300.0, help="seconds for the whole run (default 300)")
    args = p.parse_args(argv)
    try:
        report = run(args)
    except ValueError as exc:
        p.error(str(exc))
    text = json.dumps(report)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
