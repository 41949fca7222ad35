"""Speculative decoding (prompt lookup, or a draft model) against plain decoding, single
stream, one engine.

    python -m benchmarks.bench_speculative [MODEL] [--spec ngram:k=4] [--tokens 128]
                                           [--decode-quant int4] [--repeats 2] [--threads 1]
    python -m benchmarks.bench_speculative --spec draft:smollm2,k=4

With draft:MODEL the draft is loaded in the same decode format; when it is the target itself
(the default model drafting for itself) the engine reuses the target's weights, so every
draft is accepted and the figures are the mechanism's ceiling: k + 1 tokens a step at the
cost of k draft passes plus one verification.

Two workloads, each greedy (temperature 0), on a decode-role engine (every pass in the decode
format, as on a decode worker): (a) copy: the model is asked to repeat a paragraph exactly,
which prompt lookup can draft from; (b) chat: an ordinary question, little to copy. For each,
plain and speculative decode tok/s (output tokens after the first over the time after the
first, best of --repeats, plain and speculative runs interleaved), the speculative runs' acceptance rate (accepted / drafted tokens)
and output tokens per decode step, the ratio, and whether the two outputs are identical (they must be: greedy equality).
Then what a verification costs: one decode pass of 1..k+1 tokens (every row with logits) at
context 150, median of 15, against the one-token pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from benchmarks.bench_engine import cpu_summary
from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.generation import chat_prompt_ids
from engine.llm_engine import LLMEngine
from engine.model_runner import SequenceChunk
from cli.load_generator import copy_prompt, write_prompt
from engine.speculative_config import parse_speculative
from worker.runtime import configure_process

# The workloads `tandem bench --dataset copy|write` sends a served cluster, one prompt each.
WORKLOADS = {"copy": copy_prompt(0), "chat": write_prompt(0)}


def decode_rate(engine: LLMEngine, prompt: list[int], tokens: int
                ) -> tuple[float, list[int], float]:
    """(decode tok/s after the first token, the output, output tokens per decode step)."""
    out: list[int] = []
    first = None
    steps = 0
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, num_predict=tokens))
    while engine.has_unfinished():
        steps += first is not None
        for step in engine.step():
            if step.request_id == request.request_id:
                out.extend(step.new_token_ids)
                if first is None and out:
                    first = (time.perf_counter(), len(out))
    elapsed = time.perf_counter() - first[0]
    decoded = len(out) - first[1]
    return decoded / elapsed if elapsed > 0 else 0.0, out, decoded / max(1, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.bench_speculative")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF or HF directory (default: the store's smollm2)")
    p.add_argument("--spec", default="ngram:k=4", help="--speculative value (default ngram:k=4)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per run (default 128)")
    p.add_argument("--decode-quant", default="int4", help="decode weight format (default int4)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per case, interleaved, best taken (default 3)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    configure_process(args.threads)
    if args.model is None:
        from cli.common_args import resolve_or_pull

        args.model = str(resolve_or_pull("smollm2"))
    speculative = parse_speculative(args.spec)
    config = EngineConfig.for_role("decode", args.decode_quant,
                                   cache=CacheConfig(num_blocks=256, enable_prefix_caching=False))
    plain = LLMEngine.from_path(args.model, config)
    draft = None
    if speculative.method == "draft":
        from pathlib import Path

        from common.model_store import default_store
        from engine.llm_engine import load_draft

        draft_path = default_store().resolve(speculative.draft_model)
        draft = (plain.model if Path(draft_path).resolve() == Path(args.model).resolve()
                 else load_draft(speculative.draft_model, Path(args.model), plain.config.model,
                                 plain.config.weight_format, plain.runner.device))
    spec = LLMEngine(plain.model, replace(plain.config, speculative=speculative), plain.tokenizer,
                     draft_model=draft)
    print(f"# {cpu_summary()}; threads={args.threads}; decode format {args.decode_quant}; "
          f"{args.tokens} tokens greedy; {args.spec}; best of {args.repeats}")
    print("| workload | plain tok/s | spec tok/s | ratio | acceptance | tokens/step | same output |")
    print("|---|---|---|---|---|---|---|")
    for name, text in WORKLOADS.items():
        prompt = chat_prompt_ids(plain, [{"role": "user", "content": text}])
        before = replace(spec.spec_stats)
        # Interleaved, so that a change in the host's load falls on both alike.
        plain_runs, spec_runs = [], []
        for _ in range(args.repeats):
            plain_runs.append(decode_rate(plain, prompt, args.tokens))
            spec_runs.append(decode_rate(spec, prompt, args.tokens))
        stats = spec.spec_stats
        drafted = stats.num_draft_tokens - before.num_draft_tokens
        accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        base, fast = max(r[0] for r in plain_runs), max(r[0] for r in spec_runs)
        same = all(r[1] == plain_runs[0][1] for r in plain_runs + spec_runs)
        print(f"| {name} | {base:.1f} | {fast:.1f} | {fast / base:.2f} | "
              f"{accepted / drafted if drafted else 0:.2f} | {spec_runs[-1][2]:.2f} | "
              f"{'yes' if same else 'NO'} |")
    print_pass_costs(plain, speculative.num_speculative_tokens + 1)
    return 0


def print_pass_costs(engine: LLMEngine, widest: int, context: int = 150) -> None:
    """Median time of one decode pass of 1..widest tokens after `context` cached ones."""
    bs = engine.config.cache.block_size
    table = list(range(-(-(context + widest) // bs)))
    ids = [(7 * i) % 1000 + 10 for i in range(context + widest)]
    engine.runner.execute([SequenceChunk(ids[:context], 0, table, True, is_decode=False)])
    base = None
    print("| pass tokens | ms | vs 1 token |")
    print("|---|---|---|")
    for width in range(1, widest + 1):
        chunk = SequenceChunk(ids[context:context + width], context, table, True,
                              num_logits=width, is_decode=True)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            engine.runner.execute([chunk])
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1000
        base = base or ms
        print(f"| {width} | {ms:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
