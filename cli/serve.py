"""`tandem serve`: the coordinator and its workers on this host (Ollama API). Like `ollama
serve`, it listens at $OLLAMA_HOST unless --host/--port say otherwise, and logs to stderr.
`--model` repeats: each model gets its own workers (--prefill/--decode of them, or one
--colocated; `--workers MODEL=P:D`, repeatable, gives a model counts of its own), one
coordinator serves them all and routes each request by its model."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from cli.common_args import DEFAULT_MODEL, VersionAction, resolve_or_pull
from common.errors import TandemError
from common.log_format import LOG_FORMATS
from common.tracing import add_tracing_flag
from common.model_store import default_home
from worker.config import DEFAULT_KV_BACKEND, DEFAULT_TOKEN_BUDGET
from worker.flags import add_engine_flags, add_kv_backend_flag, add_worker_flags


def register(subparsers) -> None:
    from coordinator.api_tls import add_api_tls_args  # torch-free

    p = subparsers.add_parser("serve", help="serve a model: coordinator + prefill and decode workers")
    p.add_argument("--model", action="append",
                   help="model name (pulled if missing), GGUF file or Hugging Face directory; "
                        "repeat it to serve several models, each with its own workers "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--chat-template", action="append", metavar="FILE",
                   help="a Jinja chat template file the n-th --model renders instead of its "
                        "own, e.g. one that reads `tools` (repeatable; default: the model's, "
                        "or the tools template tandem ships for its family)")
    p.add_argument("--chat-template-for", action="append", default=[], metavar="MODEL=FILE",
                   help="a Jinja chat template file MODEL renders instead of its own: a "
                        "--model by name, or with --load-on-request a model a request may "
                        "load (repeatable)")
    p.add_argument("--version", action=VersionAction)
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
    p.add_argument("--prefill", type=int, default=1,
                   help="prefill workers of each model (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers of each model (default 1)")
    p.add_argument("--workers", action="append", default=[], metavar="MODEL=P:D",
                   help="P prefill and D decode workers for MODEL (a --model, as given, or with "
                        "--load-on-request a model a request may load), instead of "
                        "--prefill/--decode; repeatable, e.g. --workers qwen3:8b=2:3")
    p.add_argument("--colocated", action="store_true",
                   help="one worker doing prefill and decode instead")
    p.add_argument("--load-on-request", action="store_true",
                   help="a request may name a model the stores hold (tandem's, Ollama's, the "
                        "Hugging Face cache) that no --model serves: its workers (--prefill/"
                        "--decode of them, or one --colocated) start then, the request waiting, "
                        "as Ollama loads a model; keep_alive unloads it (its workers stop)")
    p.add_argument("--max-loaded-models", type=int, metavar="N",
                   help="with --load-on-request: most models loaded at once, the --model ones "
                        "included; the least recently used idle one loaded on request is "
                        "unloaded to make room (default: no bound)")
    p.add_argument("--model-memory-budget", metavar="SIZE",
                   help="with --load-on-request: most bytes of model weights loaded at once "
                        "(the weight files' sizes, e.g. 16GB or 900MiB), the --model ones "
                        "included; unloads as --max-loaded-models does (default: no bound)")
    add_kv_backend_flag(p, auto=True)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_TOKEN_BUDGET,
                   help="per-pass token budget of every worker (their --max-batched-tokens), so "
                        "also the largest prefill chunk on a prefill worker (the coordinator's "
                        f"--chunk-size; default {DEFAULT_TOKEN_BUDGET})")
    p.add_argument("--local-chunk-size", type=int,
                   help="largest prefill chunk per pass of a prompt prefilled on a decode worker, "
                        "beside its decodes (coordinator default 64)")
    p.add_argument("--prefill-threshold", type=int,
                   help="prompts of at most this many tokens may prefill on the decode worker")
    p.add_argument("--local-prefill-max-stall-ms", type=float,
                   help="... and on a busy decode worker only if that stalls its running streams "
                        "by at most this many ms (coordinator default 100)")
    add_engine_flags(p, "serve")
    add_worker_flags(p, "serve")
    p.add_argument("--no-core-lease", dest="core_lease", action="store_false",
                   help="each worker keeps to its own --threads (default: decode workers also "
                        "use idle prefill workers' cores, through a core lease on this host)")
    p.add_argument("--max-streams", type=int,
                   help="most requests open at once, queued or running (429 above; coordinator "
                        "default 512)")
    p.add_argument("--response-cache", metavar="MODE",
                   help="the coordinator answers repeated requests from memory: exact, or "
                        "semantic[:threshold=T] (also a paraphrased last user turn); "
                        "',model=NAME' embeds the turns with a served embedding model (a "
                        "threshold required), ',match=literals' leaves the words to it; "
                        "',entries=N,bytes=B' bound it (default off)")
    add_api_tls_args(p)
    p.add_argument("--log-dir", help="where process logs go (default $TANDEM_HOME/logs/serve-*)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="every process's log lines: text, or one JSON object per line (ts, "
                        "level, logger, msg, request_id when known; default text)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access log line per HTTP request in the coordinator's log")
    add_tracing_flag(p)  # given to every process
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds to wait for every worker to register (default 300)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from deploy.cluster_secret import cluster_secret
    from deploy.local import serve
    from deploy.local_topology import Topology

    log_dir = Path(args.log_dir) if args.log_dir else default_home() / "logs" / time.strftime(
        "serve-%Y%m%d-%H%M%S")
    host, port = serve_address(args.host, args.port, os.environ.get("OLLAMA_HOST"))
    api_key = args.api_key or os.environ.get("TANDEM_API_KEY", "").strip() or None
    # Secure by default: the internal plane always has a secret, the operator's
    # $TANDEM_CLUSTER_SECRET or one made for this cluster; every process gets it in its
    # environment (a worker that lacks it cannot register and receive prompts).
    secret, _ = cluster_secret(os.environ)
    models = args.model or [DEFAULT_MODEL]
    try:
        # Checked before the models are resolved (or pulled) and before anything starts.
        topology = Topology(model=models[0], model_path=Path(models[0]),
                            more_models=tuple((m, Path(m)) for m in models[1:]), log_dir=log_dir,
                            host=host, port=port, api_key=api_key, prefill=args.prefill,
                            decode=args.decode, colocated=args.colocated,
                            model_workers=model_workers(args.workers),
                            kv_backend=DEFAULT_KV_BACKEND if args.kv_backend == "auto"
                            else args.kv_backend, chunk_size=args.chunk_size,
                            prefill_threshold=args.prefill_threshold,
                            prefill_quant=args.prefill_quant, decode_quant=args.decode_quant,
                            threads=args.threads, num_blocks=args.num_blocks,
                            kv_dtype=args.kv_dtype, local_chunk_size=args.local_chunk_size,
                            local_prefill_max_stall_ms=args.local_prefill_max_stall_ms,
                            speculative=args.speculative,
                            max_streams=args.max_streams, device=args.device,
                            cuda_graphs=not args.no_cuda_graphs,
                            batch_invariant=args.batch_invariant,
                            coordinator_args=("--grpc-port", str(args.grpc_port),
                                              *_chat_template_args(args.chat_template, models),
                                              *_templates_for_args(args, models),
                                              *_response_cache(args.response_cache, models,
                                                               args.load_on_request),
                                              *_on_request_args(args)),
                            load_on_request=args.load_on_request,
                            api_tls=_api_tls(args), cluster_secret=secret,
                            log_format=args.log_format, access_log=args.access_log,
                            otlp_traces_endpoint=args.otlp_traces_endpoint,
                            otlp_traces_protocol=args.otlp_traces_protocol,
                            core_lease=args.core_lease)
        from engine.device import resolve_device

        # The workers run here: a CUDA-less host fails now, not in them.
        device = resolve_device(args.device)
    except ValueError as exc:
        raise TandemError(str(exc)) from None
    topology = dataclasses.replace(
        topology, model_path=resolve_or_pull(models[0]),
        more_models=tuple((m, resolve_or_pull(m)) for m in models[1:]))
    if args.kv_backend == "auto":
        from deploy.kv_backend_choice import choose

        backend, why = choose(topology, device.torch_device.type)
        topology = dataclasses.replace(topology, kv_backend=backend)
        _log(f"KV transfer: {backend} ({why})")
    factory = None
    if topology.load_on_request:
        from deploy.model_supervisor import ModelSupervisor

        factory = ModelSupervisor
    return serve(topology, start_timeout_s=args.start_timeout, out=_log,
                 lock_dir=default_home() / "run", more_ports=(args.grpc_port,),
                 supervisor_factory=factory)


def _on_request_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The coordinator's bounds on the models loaded on request, checked here first."""
    from coordinator.model_budget import ModelBudget, parse_size  # torch-free

    bounds = (("--max-loaded-models", args.max_loaded_models),
              ("--model-memory-budget", args.model_memory_budget))
    given = [(flag, value) for flag, value in bounds if value is not None]
    if given and not args.load_on_request:
        raise ValueError(f"{given[0][0]} bounds the models loaded on request: give "
                         "--load-on-request too")
    ModelBudget(args.max_loaded_models, parse_size(args.model_memory_budget)
                if args.model_memory_budget is not None else None)  # ValueError naming it
    if not args.load_on_request:
        return ()
    return (*(a for flag, value in given for a in (flag, str(value))),
            "--model-start-timeout", str(args.start_timeout))


def model_workers(values: list[str]) -> tuple[tuple[str, int, int], ...]:
    """--workers MODEL=P:D values as (model, prefill, decode). The last "=" splits, so a model
    path may hold one; Topology checks that each MODEL is served and the counts' ranges."""
    out = []
    for value in values:
        model, _, counts = value.rpartition("=")
        prefill, colon, decode = counts.partition(":")
        if not (model and colon and prefill.isdigit() and decode.isdigit()):
            raise TandemError(f"--workers {value!r}: expected MODEL=PREFILL:DECODE, two whole "
                              "numbers, e.g. qwen3:8b=1:2")
        out.append((model, int(prefill), int(decode)))
    return tuple(out)


def _chat_template_args(files: list[str] | None, models: list[str]) -> tuple[str, ...]:
    """--chat-template for the coordinator (which renders prompts; workers get token ids),
    each file checked to parse here, before anything starts."""
    from common.chat_template_choice import read_template_file

    if files and len(files) > len(models):
        raise ValueError(f"{len(files)} --chat-template for {len(models)} --model: give at "
                         "most one per model")
    for file in files or ():
        try:
            read_template_file(file)
        except TandemError as exc:
            raise ValueError(str(exc)) from None
    return tuple(a for f in files or () for a in ("--chat-template", str(Path(f).resolve())))


def _templates_for_args(args: argparse.Namespace, models: list[str]) -> tuple[str, ...]:
    """--chat-template-for for the coordinator, each file checked to parse here, and each
    MODEL a --model unless models load on request."""
    from common.chat_template_choice import check_templates_served, templates_by_model
    from common.model_name import name_key

    templates = templates_by_model(args.chat_template_for)  # ChatTemplateError naming it
    check_templates_served(templates, models, args.load_on_request)
    named = (value.partition("=")[0].strip() for value in args.chat_template_for)
    return tuple(a for model in named
                 for a in ("--chat-template-for", f"{model}={templates[name_key(model)]}"))


def _response_cache(spec: str | None, models: list[str] = (),
                    load_on_request: bool = False) -> tuple[str, ...]:
    """The coordinator's --response-cache, checked here first (a ValueError naming it): its
    embedding model must be one of the --model ones (the coordinator answers to the same
    spellings, common/model_name.name_key) unless models load on request."""
    if spec is None:
        return ()
    from common.model_name import name_key, path_spellings
    from coordinator.response_cache_config import ResponseCacheConfig  # torch-free

    embedder = ResponseCacheConfig.parse(spec).embed_model
    # Every spelling the coordinator's served model answers to that the flag alone shows (a
    # store alias it may also have is left to the coordinator's own check at start).
    spellings = {name_key(n) for m in models for n in (m, *path_spellings(m))}
    if embedder is not None and not load_on_request and name_key(embedder) not in spellings:
        raise ValueError(f"--response-cache: the embedding model {embedder!r} is not served; "
                         f"add --model {embedder} (or load models on request)")
    return ("--response-cache", spec)


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
