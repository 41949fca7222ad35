"""`tandem plan`: how many prefill and decode workers a load needs, by simulation.

    tandem plan --profile PROFILE.json --rate 100 --prompt-len lognormal:800:0.8:16:8000 \\
                --output-len lognormal:200:0.7:1:2000 --slo-ttft-p99 2 --slo-tpot-p99 0.05
    tandem plan --profile PROFILE.json --trace requests.jsonl --slo-ttft-p99 2 --slo-tpot-p99 0.05
    tandem plan --measure ...            measure the profile on this host first (a checkout:
                                         benchmarks.profile_host --quick)
    tandem plan ... --fail decode:0@30 --fail prefill:0@60+20 --freeze decode:1@90
                                         every candidate must ride out these worker deaths
                                         (ROLE:INDEX@SECONDS[+RESTART_SECONDS]): requests
                                         move as the coordinator moves them, none may be lost;
                                         a frozen worker dies --heartbeat-deadline late, or
                                         resumes if it thaws before that (decode:1@90+0.5)

Prints every candidate the search simulated, the recommendation (the cheapest that meets the
SLO) with its predicted figures, and with --write-topology writes it as a topology file for
`tandem launch`. The planner itself is planner/ (pure Python); this module only parses flags,
reads files and prints.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from cli.common_args import DEFAULT_MODEL, dispatch, table


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="size a cluster for a load and an SLO (simulated from a cost profile)",
        description="Simulate candidate topologies for a load (a trace, or Poisson arrivals at "
                    "--rate with lengths from distributions) with per-pass costs measured on a "
                    "host, and recommend the cheapest that meets the SLO (p99 TTFT and p99 "
                    "TPOT). Lengths: N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:LOW:HIGH].")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", metavar="PROFILE.json", help="cost profile (benchmarks.profile_host)")
    src.add_argument("--measure", action="store_true",
                     help="measure a quick profile on this host first (needs a checkout)")
    p.add_argument("--measure-model", default=DEFAULT_MODEL, help=f"model --measure runs (default {DEFAULT_MODEL})")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="requests per second (Poisson arrivals)")
    load.add_argument("--trace", metavar="FILE.jsonl", help="a request trace (planner/trace.py)")
    p.add_argument("--prompt-len", default="512", help="prompt tokens (with --rate; default 512)")
    p.add_argument("--output-len", default="128", help="output tokens (with --rate; default 128)")
    p.add_argument("--requests", type=int, default=20000, help="requests generated with --rate (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--slo-ttft-p99", type=float, required=True, metavar="S", help="p99 TTFT bound, seconds")
    p.add_argument("--slo-tpot-p99", type=float, required=True, metavar="S", help="p99 TPOT bound, seconds")
    p.add_argument("--max-workers", type=int, default=100_000, help="most prefill + decode workers")
    p.add_argument("--token-budgets", type=_ints, default=(512, 1024, 2048),
                   help="prefill pass token budgets to try (default 512,1024,2048)")
    p.add_argument("--max-batches", type=_ints, default=(64, 128, 256),
                   help="decode batch caps to try (default 64,128,256)")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV pool of a decode worker, in blocks (default 0: unbounded)")
    p.add_argument("--prefill-cost", type=float, default=1.0,
                   help="cost of a prefill worker (e.g. its cores; default 1: count workers)")
    p.add_argument("--decode-cost", type=float, default=1.0, help="cost of a decode worker (default 1)")
    p.add_argument("--fail", action="append", default=[], metavar="ROLE:INDEX@S[+RESTART_S]",
                   help="a worker dies S seconds into the load (and comes back empty RESTART_S "
                        "later); repeatable; a candidate meets the SLO only if no request is lost")
    p.add_argument("--freeze", action="append", default=[], metavar="ROLE:INDEX@S[+THAW_S]",
                   help="a worker freezes S seconds into the load (stopped or hung: alive to the "
                        "coordinator until its heartbeat deadline, then dead and its requests "
                        "moved) and thaws THAW_S after the freeze: before the deadline it "
                        "resumes where it stopped and nothing moves, after it it comes back "
                        "empty; repeatable")
    p.add_argument("--heartbeat-deadline", type=float, default=3.0, metavar="S",
                   help="when the coordinator declares a silent worker dead (default 3: tandem "
                        "coordinator's 1 s heartbeats x 3 misses)")
    p.add_argument("--write-topology", metavar="OUT.toml", help="write the recommendation for `tandem launch`")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model in the written topology (default {DEFAULT_MODEL})")
    p.set_defaults(func=cmd_plan)


def _deadline(args: argparse.Namespace) -> float:
    if not (args.heartbeat_deadline > 0 and args.heartbeat_deadline < float("inf")):
        raise ValueError(f"--heartbeat-deadline must be a time > 0, got {args.heartbeat_deadline:g}")
    return args.heartbeat_deadline


def cmd_plan(args: argparse.Namespace) -> int:
    from planner import trace as traces
    from planner.cost_profile import CostProfile
    from planner.metrics import SLO
    from planner.search import SearchSpace, search
    from planner.simulator import WorkerFailure
    from planner.topology_toml import topology_toml

    try:
        slo = SLO(args.slo_ttft_p99, args.slo_tpot_p99)
        profile = CostProfile.load(args.profile) if args.profile else measure(args.measure_model)
        if args.trace:
            requests = traces.load(args.trace)
            load = f"trace {args.trace}"
        else:
            prompt, output = traces.LengthDist.parse(args.prompt_len), traces.LengthDist.parse(args.output_len)
            requests = traces.generate(args.rate, args.requests, prompt, output, args.seed)
            load = (f"{args.requests} requests, Poisson at {args.rate:g}/s, prompt {args.prompt_len}, "
                    f"output {args.output_len}, seed {args.seed}")
        space = SearchSpace(token_budgets=args.token_budgets, max_batches=args.max_batches,
                            max_workers=args.max_workers, prefill_cost=args.prefill_cost,
                            decode_cost=args.decode_cost, kv_blocks_per_decode=args.kv_blocks,
                            failures=tuple(WorkerFailure.parse(f) for f in args.fail)
                            + tuple(WorkerFailure.parse(f, noticed_after_s=_deadline(args))
                                    for f in args.freeze))
    except (ValueError, OSError) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr)
        return 2
    span = requests[-1].arrival_s - requests[0].arrival_s
    print(f"load: {load}; {len(requests)} requests over {span:.1f} s, mean prompt "
          f"{sum(r.prompt_tokens for r in requests) / len(requests):.0f}, mean output "
          f"{sum(r.output_tokens for r in requests) / len(requests):.0f} tokens")
    print(f"profile: {profile.source or args.profile}")
    print(f"SLO: TTFT p99 <= {1e3 * slo.ttft_s:g} ms, TPOT p99 <= {1e3 * slo.tpot_s:g} ms")
    if space.failures:
        print("failures: " + ", ".join(
            f"{f.role} worker {f.index} "
            + (f"frozen at {f.at_s:g} s, thawed {f.restart_after_s:g} s later, before its "
               f"{f.noticed_after_s:g} s deadline (resumes)" if f.thaws else
               (f"frozen at {f.at_s:g} s, noticed {f.noticed_after_s:g} s later" if f.noticed_after_s
                else f"at {f.at_s:g} s")
               + (f", back after {f.restart_after_s:g} s" if f.restart_after_s is not None
                  else ", not restarted"))
            for f in space.failures))
    plan = search(requests, profile, slo, space)
    print()
    rows = [[c.phase, str(c.config.prefill_workers), str(c.config.decode_workers),
             str(c.config.token_budget), str(c.config.max_batch), f"{c.cost:g}",
             _ms(c.summary.ttft_p99_s), _ms(c.summary.tpot_p99_s), f"{c.summary.goodput_rps:.1f}",
             "yes" if c.meets else "no"] + ([str(c.summary.failed)] if space.failures else [])
            for c in plan.tried]
    table(rows, ["sizing", "prefill", "decode", "budget", "batch", "cost", "TTFT p99 ms",
                 "TPOT p99 ms", "goodput/s", "meets"] + (["lost"] if space.failures else []))
    print()
    print("TTFT p99 with a prefill worker per request (no topology does better): " + ", ".join(
        f"budget {b}: {_ms(t)} ms" for b, t in plan.ttft_floor.items()))
    if plan.best is None:
        print(f"no topology of at most {args.max_workers} workers meets the SLO")
        return 1
    c, s = plan.best.config, plan.best.summary
    print(f"recommended: {c.prefill_workers} prefill + {c.decode_workers} decode workers "
          f"(P:D = 1:{c.decode_workers / c.prefill_workers:.2f}), token budget "
          f"{c.token_budget}, decode batch cap {c.max_batch}; cost {plan.best.cost:g}")
    print(f"predicted: TTFT p50 {_ms(s.ttft_p50_s)} / p99 {_ms(s.ttft_p99_s)} ms, TPOT p50 "
          f"{_ms(s.tpot_p50_s)} / p99 {_ms(s.tpot_p99_s)} ms, ITL p50 {_ms(s.itl_p50_s)} / p99 "
          f"{_ms(s.itl_p99_s)} ms, E2E p50 {s.e2e_p50_s:.2f} / p99 {s.e2e_p99_s:.2f} s; "
          f"{s.throughput_rps:.1f} req/s, {s.output_tok_s:.0f} output tok/s, goodput "
          f"{s.goodput_rps:.1f} req/s ({100 * s.slo_attainment:.1f}% of requests within the SLO)"
          + (f"; {s.migrations} moves after the failures, none lost" if space.failures else ""))
    if args.write_topology:
        text = topology_toml(model=args.model, prefill=c.prefill_workers, decode=c.decode_workers,
                             token_budget=c.token_budget, max_batch=c.max_batch,
                             comment=f"tandem plan for {load}\nSLO TTFT p99 <= {slo.ttft_s:g} s, "
                                     f"TPOT p99 <= {slo.tpot_s:g} s")
        Path(args.write_topology).write_text(text)
        print(f"wrote {args.write_topology}")
    return 0


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1e3 * seconds:.1f}"


def measure(model: str):
    """A quick profile of this host, by benchmarks.profile_host in a child process (the
    benchmarks are a checkout's tools, not part of the installed product)."""
    from planner.cost_profile import CostProfile

    with tempfile.TemporaryDirectory(prefix="tandem-plan-") as tmp:
        out = Path(tmp) / "profile.json"
        result = subprocess.run([sys.executable, "-m", "benchmarks.profile_host", model, "--quick",
                                 "--out", str(out)], stdout=subprocess.DEVNULL)
        if result.returncode or not out.exists():
            raise ValueError("--measure: benchmarks.profile_host failed (it runs from a tandem "
                             "checkout); measure a profile there and pass --profile")
        return CostProfile.load(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.plan")
    register(parser.add_subparsers(dest="command", required=True))
    return dispatch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
