"""Measure a cost profile (planner/cost_profile.py) of this host and write it as JSON.

    python -m benchmarks.profile_host [MODEL] [--out profile.json] [--quick]
        [--prefill-format w8a8] [--decode-format int4] [--threads 1] [--backend zmq] [--no-served]

Runs benchmarks.bench_engine's own measurement (run_level, in process, at this host's
dispatch level) at a few prompt lengths and contexts, so the fit sees prefill passes of
several sizes and decode steps of several batches and contexts, and
benchmarks.bench_kvtransfer (--json) for the transfer throughput of one backend; then fits
the profile by least squares and writes it. --quick measures fewer and smaller points (for
`tandem plan --measure` and tests); the fit is then rougher.

Then, unless --quick or --no-served, what serving adds to the engine: a local cluster of one
prefill and one decode worker (benchmarks.validate_plan's topology) answers SERVED_REQUESTS
chats one at a time (no queue, no batch), and each one's measured TTFT and TPOT is set
against the fitted profile's simulation of it alone. The medians of the differences become
prefill_pass_overhead_s (the prefill worker's own time for each request, which it reports,
beyond the engine's pass), coordinator_overhead_s (tokenization, placement, the gRPC legs, the
first token's way back) and decode_step_overhead_s (the worker's loop and each token's way to
the client).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

from benchmarks.bench_engine import cpu_summary, run_level
from planner.cost_profile import fit_profile
from worker.runtime import configure_process

# (prompt_len, context, batches, more prefill lengths): prefill at prompt_len and the others,
# decode at context for each batch. The prefill cost has three coefficients (base, per token,
# per attention pair): three lengths alone fit it exactly, noise and all (its base moved
# 32-54 ms between profiles measured minutes apart here); a dozen spread over the token
# budget average it out.
POINTS = ((64, 128, "1,4,16", "16,32,96,128"), (256, 512, "1,4,16", "160,192,224,320"),
          (512, 1024, "1,8", "384,448"))
QUICK_POINTS = ((32, 64, "1,4", ""), (128, 256, "1,4", ""))


def measure_engine(model: str, formats: list[str], threads: int, quick: bool) -> list[list[dict]]:
    runs = []
    for prompt_len, context, batches, prefill_lens in (QUICK_POINTS if quick else POINTS):
        args = SimpleNamespace(model=model, formats=",".join(dict.fromkeys(formats)), prompt_len=prompt_len,
                               prefill_lens=prefill_lens,
                               context=context, batches=batches, decode_steps=4 if quick else 16,
                               repeats=1 if quick else 3, threads=threads, kv_dtype="fp32", device="cpu",
                               no_cuda_graphs=True)
        runs.append([run_level(args)])
    return runs


def measure_transfer(backend: str, quick: bool) -> dict:
    tokens = ["128", "512"] if quick else ["128", "512", "2048"]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_kvtransfer", "--backends", backend,
                          "--tokens", *tokens, "--reps", "1" if quick else "3", "--json"],
                         stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


SERVED_REQUESTS = 8  # one at a time; prompts of 40..300 words, 32 tokens out


def measure_serving(model: str, profile, prefill_format: str, decode_format: str,
                    threads: int = 1):
    """(serving's overheads on top of `profile`'s engine costs, benchmarks.validate_plan.
    ServingOverheads; the CPU seconds a request cost the workers beside their compute
    threads), from SERVED_REQUESTS chats served one at a time by a 1:1 cluster of workers of
    `threads` threads each (the profile's). The side CPU is each worker process's CPU time over
    the chats less its `threads` busiest threads' (the engine's), both workers together, per
    chat (0 where /proc cannot tell threads apart). It does not grow with the chats' output
    tokens: 20 chats of 280 tokens cost the decode worker's side threads 0.73 s with 2 tokens
    out and 0.57 s with 32 (stop 48)."""
    import random
    import tempfile
    from pathlib import Path

    from benchmarks.bench_modes import serving, warm_up
    from benchmarks.validate_plan import served_topology, serving_overheads, solo_requests
    from common.model_store import default_store
    from common.processes import thread_cpu_seconds

    with tempfile.TemporaryDirectory(prefix="tandem-profile-") as tmp:
        topology = served_topology("profile", model, default_store().resolve(model), Path(tmp), 1, 1,
                                   prefill_format, decode_format, threads)
        cluster, url = serving(topology, model)
        with cluster:
            cluster.start()
            warm_up(url, model)
            workers = [c.process.pid for c in cluster.children if c.spec.name != "coordinator"]
            before = [thread_cpu_seconds(pid) for pid in workers]
            pairs = solo_requests(url, model, profile, SERVED_REQUESTS, random.Random(7))
            after = [thread_cpu_seconds(pid) for pid in workers]
    if not pairs:
        raise RuntimeError("no served request answered: cannot measure the serving overheads")
    side = 0.0
    for b, a in zip(before, after):
        # A worker's `threads` busiest threads are its engine's (the engine thread and its
        # kernels' pool); the rest serve its RPCs and KV transfer.
        used = sorted(a[tid] - b.get(tid, 0.0) for tid in a)
        side += sum(used[:-threads]) if len(used) > threads else 0.0
    return serving_overheads(profile, [s for s, _ in pairs]), side / len(pairs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--prefill-format", default="w8a8", help="weight format of the prefill passes")
    p.add_argument("--decode-format", default="int4", help="weight format of the decode steps")
    p.add_argument("--threads", type=int, default=1, help="threads of one worker")
    p.add_argument("--backend", default="zmq", help="KV transfer backend to measure")
    p.add_argument("--no-transfer", action="store_true", help="skip the transfer measurement (free transfers)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller points; no served run")
    p.add_argument("--no-served", action="store_true",
                   help="skip the served run (serving overheads 0: the engine's costs alone)")
    args = p.parse_args(argv)
    configure_process(args.threads)
    engine = measure_engine(args.model, [args.prefill_format, args.decode_format], args.threads, args.quick)
    transfer = None if args.no_transfer else measure_transfer(args.backend, args.quick)
    model = engine[0][0]["model"]
    profile = fit_profile(engine, transfer, prefill_format=args.prefill_format,
                          decode_format=args.decode_format, backend=args.backend,
                          source=f"{cpu_summary()}; {model}; prefill {args.prefill_format}, decode "
                                 f"{args.decode_format}, {args.threads} thread(s), {args.backend}")
    if not (args.quick or args.no_served):
        served, side_cpu_s = measure_serving(args.model, profile, args.prefill_format, args.decode_format,
                                             args.threads)
        profile = replace(served.applied_to(profile), request_side_cpu_s=side_cpu_s,
                          source=f"{profile.source}; serving overheads from {served.requests} requests "
                                 "served one at a time")
    profile.save(args.out)
    print(json.dumps(profile.to_json(), indent=2))


if __name__ == "__main__":
    main()
