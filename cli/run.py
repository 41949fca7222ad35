"""`tandem run MODEL [PROMPT]`: generate (an interactive chat without a prompt), through the
running server, or in this process without one (or with --local). In this process an Ollama
model's params and system layers apply as the server applies them (common/model_defaults.py):
its options under the flags given, its system prompt unless --system is."""

from __future__ import annotations

import argparse
import os
import sys

from common.errors import TandemError
from cli.common_args import add_server_args, resolve_or_pull, server, store
from worker.flags import add_engine_flags


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from a model (interactive without a prompt)")
    p.add_argument("model", help="model name (e.g. smollm2), GGUF file or Hugging Face directory")
    p.add_argument("prompt", nargs="*", help="prompt; omit for an interactive chat")
    p.add_argument("--system", help="system message")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, help="sample from the k likeliest tokens; 0 = off (default 40)")
    p.add_argument("--top-p", type=float, help="nucleus sampling; 1 = off (default 0.9)")
    p.add_argument("--min-p", type=float, help="drop tokens below min-p x the likeliest's probability")
    p.add_argument("--repeat-penalty", type=float, help="penalty on recent tokens; 1 = off (default 1)")
    p.add_argument("--seed", type=int, help="same seed, same answer (default: random)")
    p.add_argument("--num-predict", type=int, help="most tokens to generate (default: to the context's end)")
    p.add_argument("--num-ctx", type=int, help="context window in tokens (default: the model's)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_flags(p, "run")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TANDEM_THREADS", "1")),
                   help="threads of the in-process engine, torch's and the native kernels' "
                        "(default $TANDEM_THREADS or 1)")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer")
    add_server_args(p)
    p.add_argument("--local", action="store_true",
                   help="run the model in this process even if a server is running")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    running = None if args.local else server(args)
    if running is not None and running.running():
        answer = _remote_answerer(args, running, history)
    else:
        answer = _local_answerer(args, history)
    return _converse(args, answer, history)


def _options(args: argparse.Namespace) -> dict:
    """The sampling options given, checked as SamplingParams checks them."""
    from common.sampling_params import SamplingParams

    options = {k: v for k, v in {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed,
        "num_predict": args.num_predict, "num_ctx": args.num_ctx, "stop": args.stop,
    }.items() if v is not None}
    SamplingParams.from_options(options)  # the same checks, before anything is sent or loaded
    return options


def _answerer(history: list[dict], reply_to, verbose: bool):
    """answer(prompt): the reply streamed to stdout and kept in `history` with the prompt.
    reply_to(history) -> (the reply's text pieces, a function giving the timings line that
    --verbose prints once the pieces are spent)."""

    def answer(prompt: str) -> str:
        history.append({"role": "user", "content": prompt})
        stream, timings = reply_to(history)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if verbose:
            sys.stderr.write(timings() + "\n")
        reply = "".join(pieces)
        history.append({"role": "assistant", "content": reply})
        return reply

    return answer


def _remote_answerer(args: argparse.Namespace, running, history: list[dict]):
    options = _options(args)

    def reply_to(messages: list[dict]):
        final: dict = {}

        def pieces():
            for obj in running.chat(args.model, messages, options):
                final.clear()
                final.update(obj)
                yield obj.get("message", {}).get("content", "")

        def timings() -> str:
            ns = 1e9
            ev, evd = final.get("eval_count", 0), final.get("eval_duration", 0)
            return (f"prompt eval: {final.get('prompt_eval_count', 0)} tokens "
                    f"({(final.get('tandem') or {}).get('cached_tokens', 0)} cached) in "
                    f"{final.get('prompt_eval_duration', 0) / ns:.3f}s; eval: {ev} tokens in "
                    f"{evd / ns:.3f}s ({(ev - 1) / (evd / ns) if evd else 0:.1f} tokens/s); "
                    f"total {final.get('total_duration', 0) / ns:.3f}s; "
                    f"done: {final.get('done_reason')}")

        return pieces(), timings

    return _answerer(history, reply_to, args.verbose)


def _local_answerer(args: argparse.Namespace, history: list[dict]):
    from common.sampling_params import SamplingParams
    from engine.config import CacheConfig, EngineConfig
    from engine.generation import TextStream, chat_prompt_ids
    from engine.llm_engine import LLMEngine
    from worker.runtime import configure_process

    # Checked before the model is resolved (or pulled) and loaded.
    from engine.speculative_config import parse_speculative

    try:
        speculative = parse_speculative(args.speculative)
    except ValueError as exc:
        raise TandemError(str(exc)) from None
    config = EngineConfig.for_role("colocated", args.decode_quant, args.prefill_quant,
                                   cache=CacheConfig(kv_dtype=args.kv_dtype), device=args.device,
                                   cuda_graphs=not args.no_cuda_graphs, speculative=speculative)
    configure_process(args.threads, batch_invariant=args.batch_invariant)
    options = _options(args)
    path = resolve_or_pull(args.model)
    defaults = store().defaults_for(args.model, path)
    params = SamplingParams.from_options(defaults.options_under(options))
    if defaults.system is not None and not history:  # no --system
        history.append({"role": "system", "content": defaults.system})
    engine = LLMEngine.from_path(path, config)

    def reply_to(messages: list[dict]):
        stream = TextStream(engine, chat_prompt_ids(engine, messages), params)

        def timings() -> str:
            s = stream.stats
            return (f"prompt eval: {s.prompt_tokens} tokens ({s.cached_tokens} cached) in "
                    f"{s.prompt_eval_s:.3f}s; eval: {s.output_tokens} tokens in {s.eval_s:.3f}s "
                    f"({(s.output_tokens - 1) / s.eval_s if s.eval_s > 0 else 0:.1f} tokens/s); "
                    f"done: {s.done_reason}")

        return stream, timings

    return _answerer(history, reply_to, args.verbose)


def _converse(args: argparse.Namespace, answer, history: list[dict]) -> int:
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
