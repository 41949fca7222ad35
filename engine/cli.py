"""`tandem`: the command line. The environment (TANDEM_HOME) is read here and nowhere deeper.

    tandem pull smollm2                 fetch the default model into the cache
    tandem list                         cached models
    tandem run MODEL [PROMPT] [opts]    generate (interactive chat without a prompt)
"""

from __future__ import annotations

import argparse
import os
import sys

from engine.errors import TandemError
from engine.model_store import ModelStore, default_home

DEFAULT_MODEL = "smollm2"


def _progress(done: int, total: int) -> None:
    pct = 100.0 * done / total if total else 0.0
    sys.stderr.write(f"\rpulling: {done / 1e6:7.1f} / {total / 1e6:.1f} MB ({pct:5.1f}%)")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _store() -> ModelStore:
    return ModelStore(default_home())


def cmd_pull(args: argparse.Namespace) -> int:
    path = _store().pull(args.model, progress=_progress)
    print(f"{args.model}: {path}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    entries = _store().list()
    print(f"{'NAME':32} {'SIZE':>10}  {'DIGEST':14} MODIFIED")
    for e in entries:
        print(f"{e.name:32} {e.size / 1e6:8.1f}MB  {e.digest[:12]:14} {e.modified_at:%Y-%m-%d %H:%M}")
    return 0


def _resolve_or_pull(name: str):
    store = _store()
    try:
        return store.resolve(name)
    except TandemError:
        if name not in store.known_names():
            raise
        return store.pull(name, progress=_progress)


def _sampling_params(args: argparse.Namespace):
    from engine.sampling_params import SamplingParams

    options = {k: v for k, v in {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed,
        "num_predict": args.num_predict, "num_ctx": args.num_ctx, "stop": args.stop,
    }.items() if v is not None}
    return SamplingParams.from_options(options)


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from engine.generation import TextStream, chat_prompt_ids
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    params = _sampling_params(args)
    path = _resolve_or_pull(args.model)
    engine = LLMEngine.from_path(path, weight_format=args.weight_format)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []

    def answer(prompt: str) -> str:
        history.append({"role": "user", "content": prompt})
        stream = TextStream(engine, chat_prompt_ids(engine, history), params)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if args.verbose:
            s = stream.stats
            sys.stderr.write(
                f"prompt eval: {s.prompt_tokens} tokens ({s.cached_tokens} cached) in {s.prompt_eval_s:.3f}s; "
                f"eval: {s.output_tokens} tokens in {s.eval_s:.3f}s "
                f"({(s.output_tokens - 1) / s.eval_s if s.eval_s > 0 else 0:.1f} tokens/s); "
                f"done: {s.done_reason}\n")
        reply = "".join(pieces)
        history.append({"role": "assistant", "content": reply})
        return reply

    if args.prompt:
        answer(" ".join(args.prompt))
        return 0
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write(">>> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if line in ("/bye", "/exit"):
            return 0
        if line == "/clear":
            del history[1 if args.system else 0:]
            continue
        if line:
            answer(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download a model into the cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", aliases=["ls"], help="list cached models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("run", help="generate from a model (interactive without a prompt)")
    p.add_argument("model", help="model name (e.g. smollm2), GGUF file or Hugging Face directory")
    p.add_argument("prompt", nargs="*", help="prompt; omit for an interactive chat")
    p.add_argument("--system", help="system message")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--num-predict", type=int)
    p.add_argument("--num-ctx", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--weight-format", default="fp32", help="fp32 | bf16")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TANDEM_THREADS", "1")))
    p.add_argument("--verbose", action="store_true", help="print timings after each answer")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TandemError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
