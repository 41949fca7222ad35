"""`tandem`: the command line. The environment (TANDEM_HOME, OLLAMA_HOST, TANDEM_API_KEY) is
read here and nowhere deeper.

    tandem pull smollm2                 fetch the default model into the cache
    tandem list                         the server's models, or the cache's without a server
    tandem ps                           models a running server has loaded
    tandem show MODEL                   a model's details (from the server, else the cache)
    tandem run MODEL [PROMPT] [opts]    generate (interactive chat without a prompt): through
                                        the running server, or in this process without one
    tandem serve [--prefill N --decode M | --colocated] [--kv-backend zmq|shm|grpc|dist]
                 [--prefill-quant F] [--decode-quant F] [--kv-dtype fp32|bf16] [--threads N]
                 [--num-blocks N] [--chunk-size N] [--local-chunk-size N] [--max-streams N]
                 [--host H] [--port P] [--api-key KEY]
                                        coordinator + workers on this host (Ollama API);
                                        like `ollama serve`, it listens at $OLLAMA_HOST unless
                                        --host/--port say otherwise, and logs to stderr
    tandem bench [opts]                 load generator against a tandem/Ollama/OpenAI server
    tandem launch TOPOLOGY.toml         a multi-host topology (cli/launch.py)
    tandem --version                    the installed package's version

The server is found at --host, else $OLLAMA_HOST, else 127.0.0.1:11434 (as ollama's CLI), and
is sent $TANDEM_API_KEY, if set, as `Authorization: Bearer KEY`. An https:// host's certificate
is checked against --ca-file (else $TANDEM_CA_FILE, else the system's CAs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cli.launch import add_launch_parser
from common.errors import TandemError
from common.model_store import ModelStore, default_home

DEFAULT_MODEL = "smollm2"
# The fastest formats that keep answers right on the default model (README: quality table).
DEFAULT_PREFILL_QUANT = "fp32"
DEFAULT_DECODE_QUANT = "int4"


def _store() -> ModelStore:
    return ModelStore(default_home())


def _pull(store: ModelStore, name: str):
    """store.pull with progress bars on stderr (cli/pull_progress.py)."""
    from cli.pull_progress import PullBars

    with PullBars() as bars:
        return store.pull(name, progress=bars)


def cmd_pull(args: argparse.Namespace) -> int:
    path = _pull(_store(), args.model)
    print(f"{args.model}: {path}")
    return 0


def _server(args: argparse.Namespace):
    from deploy.remote import Server, base_url

    return Server(base_url(args.host or os.environ.get("OLLAMA_HOST")),
                  api_key=os.environ.get("TANDEM_API_KEY", "").strip() or None,
                  ca_file=args.ca_file or os.environ.get("TANDEM_CA_FILE", "").strip() or None)


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def cmd_list(args: argparse.Namespace) -> int:
    server = _server(args)
    if server.running():
        _table([[m["name"], m["digest"][:16], f"{m['size'] / 1e6:.1f} MB", m["modified_at"][:19]]
                for m in server.tags()], ["NAME", "ID", "SIZE", "MODIFIED"])
        return 0
    entries = _store().list()
    print(f"{'NAME':32} {'SIZE':>10}  {'DIGEST':14} MODIFIED")
    for e in entries:
        print(f"{e.name:32} {e.size / 1e6:8.1f}MB  {e.sha256[:12]:14} {e.modified_at:%Y-%m-%d %H:%M}")
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    server = _server(args)
    if not server.running():
        raise TandemError(f"no tandem server is running at {server.url} (start one with "
                          "`tandem serve`)")
    _table([[m["name"], m["digest"][:16], f"{m['size'] / 1e6:.1f} MB",
             f"{m.get('context_length', '')}", "Forever"] for m in server.ps()],
           ["NAME", "ID", "SIZE", "CONTEXT", "UNTIL"])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    server = _server(args)
    if server.running():
        shown = server.show(args.model)
        details, info = shown["details"], shown.get("model_info") or {}
        arch = info.get("general.architecture", details.get("family", ""))
        rows = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
                ("context length", info.get(f"{arch}.context_length", "")),
                ("embedding length", info.get(f"{arch}.embedding_length", "")),
                ("quantization", details.get("quantization_level", "")),
                ("format", details.get("format", ""))]
        capabilities = shown.get("capabilities") or []
    else:
        from common.model_files import load_config

        path = _store().resolve(args.model)
        config = load_config(path)
        rows = [("architecture", config.architecture), ("path", str(path)),
                ("context length", config.max_position),
                ("embedding length", config.hidden_size), ("layers", config.num_layers)]
        capabilities = ["completion"]
    print("  Model")
    for key, value in rows:
        print(f"    {key:<20}{value}")
    print("\n  Capabilities")
    for capability in capabilities:
        print(f"    {capability}")
    return 0


def _resolve_or_pull(name: str):
    store = _store()
    try:
        return store.resolve(name)
    except TandemError:
        if name not in store.known_names():
            raise
        return _pull(store, name)


def _sampling_params(args: argparse.Namespace):
    from common.sampling_params import SamplingParams

    options = {k: v for k, v in {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed,
        "num_predict": args.num_predict, "num_ctx": args.num_ctx, "stop": args.stop,
    }.items() if v is not None}
    return SamplingParams.from_options(options)


def _options(args: argparse.Namespace) -> dict:
    _sampling_params(args)  # the same checks, before anything is sent
    return {k: v for k, v in {
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed,
        "num_predict": args.num_predict, "num_ctx": args.num_ctx, "stop": args.stop,
    }.items() if v is not None}


def _remote_answerer(args: argparse.Namespace, server, history: list[dict]):
    options = _options(args)

    def answer(prompt: str) -> str:
        history.append({"role": "user", "content": prompt})
        pieces, final = [], {}
        for obj in server.chat(args.model, history, options):
            piece = obj.get("message", {}).get("content", "")
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
            final = obj
        sys.stdout.write("\n")
        if args.verbose:
            ns = 1e9
            ev, evd = final.get("eval_count", 0), final.get("eval_duration", 0)
            sys.stderr.write(
                f"prompt eval: {final.get('prompt_eval_count', 0)} tokens "
                f"({(final.get('tandem') or {}).get('cached_tokens', 0)} cached) in "
                f"{final.get('prompt_eval_duration', 0) / ns:.3f}s; eval: {ev} tokens in "
                f"{evd / ns:.3f}s ({(ev - 1) / (evd / ns) if evd else 0:.1f} tokens/s); "
                f"total {final.get('total_duration', 0) / ns:.3f}s; "
                f"done: {final.get('done_reason')}\n")
        reply = "".join(pieces)
        history.append({"role": "assistant", "content": reply})
        return reply

    return answer


def cmd_run(args: argparse.Namespace) -> int:
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    server = None if args.local else _server(args)
    if server is not None and server.running():
        answer = _remote_answerer(args, server, history)
    else:
        answer = _local_answerer(args, history)
    return _converse(args, answer, history)


def _local_answerer(args: argparse.Namespace, history: list[dict]):
    from engine.generation import TextStream, chat_prompt_ids
    from engine.llm_engine import LLMEngine
    from worker.runtime import configure_process

    configure_process(args.threads)
    params = _sampling_params(args)
    path = _resolve_or_pull(args.model)
    engine = LLMEngine.from_path(path, role="colocated", weight_format=args.decode_quant,
                                 prefill_format=args.prefill_quant, kv_dtype=args.kv_dtype,
                                 device=args.device, cuda_graphs=not args.no_cuda_graphs)

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

    return answer


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


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from deploy.local import Topology, serve

    log_dir = Path(args.log_dir) if args.log_dir else default_home() / "logs" / time.strftime(
        "serve-%Y%m%d-%H%M%S")
    host, port = serve_address(args.host, args.port, os.environ.get("OLLAMA_HOST"))
    api_key = args.api_key or os.environ.get("TANDEM_API_KEY", "").strip() or None
    try:
        # Checked before the model is resolved (or pulled) and before anything starts.
        topology = Topology(model=args.model, model_path=Path(args.model), log_dir=log_dir,
                            host=host, port=port, api_key=api_key, prefill=args.prefill,
                            decode=args.decode, colocated=args.colocated,
                            kv_backend=args.kv_backend, chunk_size=args.chunk_size,
                            prefill_threshold=args.prefill_threshold,
                            prefill_quant=args.prefill_quant, decode_quant=args.decode_quant,
                            threads=args.threads, num_blocks=args.num_blocks,
                            kv_dtype=args.kv_dtype, local_chunk_size=args.local_chunk_size,
                            max_streams=args.max_streams, device=args.device,
                            cuda_graphs=not args.no_cuda_graphs,
                            coordinator_args=("--grpc-port", str(args.grpc_port)),
                            api_tls=_api_tls(args))
        from engine.device import resolve_device

        resolve_device(args.device)  # the workers run here: a CUDA-less host fails now, not in them
    except ValueError as exc:
        raise TandemError(str(exc)) from None
    topology = dataclasses.replace(topology, model_path=_resolve_or_pull(args.model))
    return serve(topology, start_timeout_s=args.start_timeout, out=_log)


def _api_tls(args: argparse.Namespace) -> tuple[str, str] | None:
    """--api-tls-cert/--api-tls-key, checked here (files, PEM, matching key) before anything
    starts, as the coordinator will check them again."""
    from coordinator.api_tls import api_tls_from

    tls = api_tls_from(args.api_tls_cert, args.api_tls_key)  # ValueError: a start-up error
    return (str(tls.cert.resolve()), str(tls.key.resolve())) if tls else None


def _log(line: str) -> None:
    """`tandem serve` logs to stderr, as `ollama serve` does (stdout stays free for pipes)."""
    print(line, file=sys.stderr, flush=True)


def serve_address(host: str | None, port: int | None, ollama_host: str | None
                  ) -> tuple[str, int]:
    """Where `tandem serve` listens: --host and --port where given, else $OLLAMA_HOST's (as
    `ollama serve`), else 127.0.0.1:11434. OLLAMA_HOST=":PORT" (no host) listens on every
    interface, as Go's net.Listen does with it."""
    from deploy.remote import DEFAULT_PORT, parse_host

    if (host is None or port is None) and (ollama_host or "").strip():
        address = parse_host(ollama_host)
        host = (address.host or "0.0.0.0") if host is None else host
        port = address.port if port is None else port
    return host or "127.0.0.1", DEFAULT_PORT if port is None else port


def add_quant_flags(p: argparse.ArgumentParser, serve: bool = False) -> None:
    from engine.config import DECODE_FORMATS, PREFILL_FORMATS

    if serve:
        prefill_help = "weight format of the prefill workers (and of a colocated worker's prompt-only passes)"
        decode_help = ("weight format of the decode workers, every pass (and of a colocated "
                       "worker's passes with decode tokens)")
    else:  # `tandem run` in this process: one colocated engine holding both
        prefill_help = "weight format of prompt-only passes"
        decode_help = "weight format of every pass with a decode token"
    p.add_argument("--prefill-quant", choices=PREFILL_FORMATS, default=DEFAULT_PREFILL_QUANT,
                   help=f"{prefill_help} (default {DEFAULT_PREFILL_QUANT})")
    p.add_argument("--decode-quant", choices=DECODE_FORMATS, default=DEFAULT_DECODE_QUANT,
                   help=f"{decode_help} (default {DEFAULT_DECODE_QUANT})")
    add_kv_dtype_flag(p, serve)
    from engine.device import add_device_flags  # torch-free

    add_device_flags(p)


def add_kv_dtype_flag(p: argparse.ArgumentParser, serve: bool = False) -> None:
    from engine.config import KV_DTYPES

    where = "of every worker (prefill and decode must agree)" if serve else "of this process's engine"
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp32",
                   help=f"element type of the KV cache {where}; bf16 halves the cache and the KV "
                        f"transfers (default fp32)")


class _VersionAction(argparse.Action):
    """--version from the installed package's metadata, looked up only when asked; a source tree
    that was never installed has no version to print, which is an error, not a guess."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print tandem's version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("tandem")
        except PackageNotFoundError:
            parser.exit(1, "Error: tandem is not installed (no package metadata), so it has no "
                           "version; pip install it\n")
        print(f"tandem {found}")  # stdout, as argparse's own "version" action
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download a model into the cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"model name (default {DEFAULT_MODEL})")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", aliases=["ls"], help="list models (the server's, or cached)")
    p.add_argument("--host", help="server address (default $OLLAMA_HOST or 127.0.0.1:11434)")
    p.add_argument("--ca-file", metavar="PEM", help="CA that signed an https:// server's "
                                                   "certificate (default $TANDEM_CA_FILE)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("ps", help="models a running server has loaded")
    p.add_argument("--host", help="server address (default $OLLAMA_HOST or 127.0.0.1:11434)")
    p.add_argument("--ca-file", metavar="PEM", help="CA that signed an https:// server's "
                                                   "certificate (default $TANDEM_CA_FILE)")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("show", help="a model's details")
    p.add_argument("model", help="model name, GGUF file or Hugging Face directory")
    p.add_argument("--host", help="server address (default $OLLAMA_HOST or 127.0.0.1:11434)")
    p.add_argument("--ca-file", metavar="PEM", help="CA that signed an https:// server's "
                                                   "certificate (default $TANDEM_CA_FILE)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("bench", help="serving benchmark (load generator)")
    from cli.load_generator import add_arguments  # torch-free

    add_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("run", help="generate from a model (interactive without a prompt)")
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
    add_quant_flags(p)
    p.add_argument("--threads", type=int, default=int(os.environ.get("TANDEM_THREADS", "1")),
                   help="torch threads of the in-process engine (default $TANDEM_THREADS or 1)")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer")
    p.add_argument("--host", help="server address (default $OLLAMA_HOST or 127.0.0.1:11434)")
    p.add_argument("--ca-file", metavar="PEM", help="CA that signed an https:// server's "
                                                   "certificate (default $TANDEM_CA_FILE)")
    p.add_argument("--local", action="store_true",
                   help="run the model in this process even if a server is running")
    p.set_defaults(func=cmd_run)

    from deploy.local import KV_BACKENDS  # torch-free

    p = sub.add_parser("serve", help="serve a model: coordinator + prefill and decode workers")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name (pulled if missing), GGUF file or Hugging Face directory")
    p.add_argument("--version", action=_VersionAction)
    p.add_argument("--host", help="HTTP address of the coordinator (default: $OLLAMA_HOST's, "
                                  "as `ollama serve`, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port of the coordinator (default: $OLLAMA_HOST's, "
                                            "else 11434)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the HTTP APIs and the gRPC "
                        "metadata 'authorization: Bearer KEY' (default $TANDEM_API_KEY; prefer "
                        "the variable: ps shows flags). Browser origins: $OLLAMA_ORIGINS")
    p.add_argument("--grpc-port", type=int, default=50051,
                   help="port of the gRPC client API (0 = any free port; default 50051)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", action="store_true",
                   help="one worker doing prefill and decode instead")
    p.add_argument("--kv-backend", choices=KV_BACKENDS, default="zmq",
                   help="KV transfer between prefill and decode workers")
    p.add_argument("--chunk-size", type=int, default=512,
                   help="per-pass token budget of every worker, so also the largest prefill chunk "
                        "on a prefill worker (default 512)")
    p.add_argument("--local-chunk-size", type=int,
                   help="largest prefill chunk per pass of a prompt prefilled on a decode worker, "
                        "beside its decodes (coordinator default 64)")
    p.add_argument("--prefill-threshold", type=int,
                   help="prompts of at most this many tokens may prefill on the decode worker")
    add_quant_flags(p, serve=True)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process (default 1)")
    p.add_argument("--num-blocks", type=int,
                   help="KV pool size per worker, in blocks (default: 1 GB of KV per worker)")
    p.add_argument("--max-streams", type=int,
                   help="most requests open at once, queued or running (429 above; coordinator "
                        "default 512)")
    from coordinator.api_tls import add_api_tls_args  # torch-free

    add_api_tls_args(p)
    p.add_argument("--log-dir", help="where process logs go (default $TANDEM_HOME/logs/serve-*)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds to wait for every worker to register (default 300)")
    p.set_defaults(func=cmd_serve)

    add_launch_parser(sub)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from cli.load_generator import run_from_args

    return run_from_args(args)


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser().parse_args(argv))


def dispatch(args: argparse.Namespace) -> int:
    """Run a parsed subcommand: a TandemError is one line on stderr and exit 1, Ctrl-C 130."""
    try:
        return args.func(args)
    except TandemError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
