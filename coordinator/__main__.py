"""`python -m coordinator --model PATH_OR_NAME [--model ...] [--host H] [--port P] ...`

One coordinator serves every --model given (the first is the default); workers of each register
with their model's fingerprint and serve only that model's requests.

The process entry: flags and the environment (read here only) -> config -> serve.
Environment: TANDEM_HOME (the model store); TANDEM_API_KEY (the client APIs' key: an
environment variable, never a flag, since ps shows every process's command line);
TANDEM_API_KEYS_FILE (named keys, `NAME KEY` per line: each name a tenant with its own prefix
cache, coordinator/tenants.py); OLLAMA_ORIGINS (browser origins allowed besides Ollama's defaults, comma-separated);
TANDEM_ALLOWED_HOSTS (Host names served besides localhost, IPs, --host, OLLAMA_HOST's and the
machine's own, comma-separated, like --allowed-hosts);
TANDEM_CLUSTER_SECRET and TANDEM_TLS_CERT/_KEY/_CA (the internal plane, common/cluster_auth.py);
TANDEM_LIFELINE_FD (set by a launcher on this host: common/lifeline.py);
OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (traces, common/tracing.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from urllib.parse import urlsplit

from coordinator.tenants import read_keys_file
from coordinator.api_tls import add_api_tls_args, api_tls_from
from coordinator.config import CoordinatorConfig
from coordinator.response_cache_config import ResponseCacheConfig
from common.cluster_auth import add_auth_args, auth_from_args
from common.addresses import is_loopback
from common.chat_template_choice import check_templates_served, templates_by_model
from common.errors import TandemError
from common.model_name import name_key
from common.lifeline import watch_launcher
from common.log_format import add_log_flags, setup_logging
from common.tracing import add_tracing_flag, endpoint_from, protocol_from, setup_tracing

DEFAULTS = CoordinatorConfig()
# The HTTP connection limits (coordinator/connection_limits.py): flag, config field, help.
CONNECTION_FLAGS = (
    ("--header-timeout", "header_timeout_s",
     "seconds a connection has to send a whole request head before it is closed"),
    ("--body-timeout", "body_timeout_s",
     "longest silence in seconds while a request body is read before the connection closes"),
    ("--idle-timeout", "idle_timeout_s",
     "seconds a keep-alive connection may stay idle between requests"),
    ("--max-connections", "max_connections", "most open HTTP connections; more are a 503"),
    ("--max-connections-per-client", "max_connections_per_client",
     "most open HTTP connections from one client address; more are a 503"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coordinator",
                                description="tandem coordinator: HTTP front door and scheduler")
    p.add_argument("--model", required=True, action="append",
                   help="model name in the store, GGUF file or HF dir (repeatable: one "
                        "coordinator serves every model given; the first is the default)")
    p.add_argument("--model-name", action="append", default=[],
                   help="name clients use, the n-th for the n-th --model (default: --model "
                        "as given)")
    p.add_argument("--chat-template", action="append", default=[], metavar="FILE",
                   help="a Jinja chat template file the n-th --model renders instead of its "
                        "own (Hugging Face's template language; e.g. one that reads `tools`)")
    p.add_argument("--chat-template-for", action="append", default=[], metavar="MODEL=FILE",
                   help="a Jinja chat template file MODEL renders instead of its own: a --model "
                        "(by name, any spelling) or, with --load-on-request, a model a request "
                        "loads; repeatable")
    p.add_argument("--host", default=DEFAULTS.host)
    p.add_argument("--port", type=int, default=DEFAULTS.port)
    p.add_argument("--registry-host", default=DEFAULTS.registry_host,
                   help="address the Registry gRPC service listens on")
    p.add_argument("--registry-port", type=int, default=DEFAULTS.registry_port,
                   help="port of the Registry gRPC service (0 = any free port)")
    p.add_argument("--grpc-host", default=DEFAULTS.grpc_host,
                   help="address of the client gRPC API (tandem.v1.Tandem, health, reflection)")
    p.add_argument("--grpc-port", type=int, default=DEFAULTS.grpc_port,
                   help="port of the client gRPC API (0 = any free port, logged)")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="Host header names the HTTP API answers to besides localhost, IP "
                        "addresses, --host, $OLLAMA_HOST's and this machine's name "
                        "(comma-separated, repeatable, added to $TANDEM_ALLOWED_HOSTS; "
                        "*.example.com for subdomains; * for any Host); others get a 403")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULTS.max_body_bytes,
                   help="largest HTTP request body (413 above); not for /api/blobs")
    p.add_argument("--max-blob-bytes", type=int, default=DEFAULTS.max_blob_bytes,
                   help="largest blob uploaded to /api/blobs (a model file, streamed to the "
                        "model store; 413 above)")
    p.add_argument("--internal-api-from", action="append", default=[], metavar="CIDR",
                   help="without a cluster secret, also serve GET /internal/workers to "
                        "clients in this network (repeatable; by default only to clients on "
                        "this host); with a secret every call needs the cluster proof")
    p.add_argument("--max-messages", type=int, default=DEFAULTS.max_messages,
                   help="most messages in one chat request")
    p.add_argument("--max-streams", type=int, default=DEFAULTS.max_streams,
                   help="most requests open at once, queued or running (429 above)")
    for flag, name, help_ in CONNECTION_FLAGS:
        default = getattr(DEFAULTS, name)
        p.add_argument(flag, type=type(default), default=default, dest=name,
                       metavar="S" if isinstance(default, float) else "N",
                       help=f"{help_} (default {default:g})")
    p.add_argument("--prefill-threshold", type=int, default=DEFAULTS.prefill_threshold,
                   help="prompts of at most this many tokens may prefill on the decode worker")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size,
                   help="largest prefill chunk per pass on a prefill worker (sent with each request); "
                        "also the budget assumed for workers that do not report one")
    p.add_argument("--local-prefill-max-stall-ms", type=float,
                   default=DEFAULTS.local_prefill_max_stall_s * 1e3,
                   help="prefill a short prompt on a busy decode worker only if that stalls its "
                        "running streams by at most this many ms (0: never on a busy one)")
    p.add_argument("--local-chunk-size", type=int, default=DEFAULTS.local_chunk_size,
                   help="largest prefill chunk per pass for a prompt prefilled on a decode worker")
    p.add_argument("--max-queue", type=int, default=DEFAULTS.max_queue)
    p.add_argument("--max-running-per-worker", type=int, default=DEFAULTS.max_running_per_worker)
    p.add_argument("--queue-timeout", type=float, default=DEFAULTS.queue_timeout_s)
    p.add_argument("--load-timeout", type=float, default=DEFAULTS.load_timeout_s,
                   help="longest wait of a request for a live decode worker (one loading the "
                        "model) before a 503; 0 = refuse at once")
    p.add_argument("--load-on-request", action="store_true",
                   help="a request may name a model the stores hold that is not served: its "
                        "workers are started through the launcher (`tandem serve` gives "
                        "$TANDEM_SUPERVISOR_FD), within --max-loaded-models and "
                        "--model-memory-budget, unloading the least recently used idle one")
    p.add_argument("--max-loaded-models", type=int, metavar="N",
                   help="with --load-on-request: most models loaded at once, those given with "
                        "--model included (default: no bound)")
    p.add_argument("--model-memory-budget", metavar="SIZE",
                   help="with --load-on-request: most bytes of model weights loaded at once "
                        "(e.g. 8GB, 512MiB; the weight files' sizes; default: no bound)")
    p.add_argument("--model-start-timeout", type=float, default=300.0, metavar="S",
                   help="with --load-on-request: longest wait for a model's workers to "
                        "register (default 300)")
    p.add_argument("--heartbeat-interval", type=float, default=DEFAULTS.heartbeat_interval_s)
    p.add_argument("--heartbeat-misses", type=int, default=DEFAULTS.heartbeat_misses)
    p.add_argument("--prefill-timeout", type=float, default=DEFAULTS.prefill_timeout_s)
    p.add_argument("--token-timeout", type=float, default=DEFAULTS.token_timeout_s)
    add_log_flags(p)  # --log-level, --log-format (common/log_format.py)
    add_tracing_flag(p)  # --otlp-traces-endpoint (common/tracing.py)
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access log line per HTTP request (method, path, status, duration, "
                        "request id; on by default at INFO, logger coordinator.access)")
    p.add_argument("--response-cache", metavar="MODE",
                   help="answer repeated requests from memory: exact, or semantic[:threshold=T] "
                        "(also a paraphrased last user turn); ',model=NAME' embeds the turns "
                        "with a served embedding model (a threshold required), ',match=literals' "
                        "leaves the words to it; ',entries=N,bytes=B' bound it "
                        "(coordinator/response_cache.py; default off)")
    add_auth_args(p)  # the internal plane's secret and TLS files
    add_api_tls_args(p)  # the client APIs' TLS, separate from the internal plane's
    return p


def _env(name: str) -> str:
    """An environment variable trimmed of spaces and quotes, as Ollama's envconfig reads one."""
    return os.environ.get(name, "").strip().strip("\"'")


def _allowed_hosts(flags: list[str]) -> tuple[str, ...]:
    """--allowed-hosts and TANDEM_ALLOWED_HOSTS, then the names this host goes by: OLLAMA_HOST's
    (`host`, `host:port`, `http://host:port`) and the machine's own, as Ollama allows it."""
    listed = [n.strip() for value in (*flags, _env("TANDEM_ALLOWED_HOSTS")) for n in value.split(",")]
    ollama_host = _env("OLLAMA_HOST")
    own = [urlsplit(ollama_host if "://" in ollama_host else f"//{ollama_host}").hostname or "",
           socket.gethostname()]
    return tuple(dict.fromkeys(n for n in (*listed, *own) if n))


def _default_keep_alive() -> float:
    """OLLAMA_KEEP_ALIVE ("5m", "1h", seconds, negative = forever), else Ollama's 5 minutes."""
    from coordinator.residency import parse_keep_alive  # noqa: PLC0415

    seconds = parse_keep_alive(_env("OLLAMA_KEEP_ALIVE") or None)
    return DEFAULTS.keep_alive_s if seconds is None else seconds


def _template_of(index: int, given: str, args: argparse.Namespace,
                 templates: dict[str, str]) -> str | None:
    """The chat template file of the `index`-th --model: its --chat-template, else the
    --chat-template-for that names it (or its --model-name); ValueError for both."""
    names = [given, *args.model_name[index:index + 1]]
    named = next((templates[name_key(n)] for n in names if name_key(n) in templates), None)
    positional = args.chat_template[index] if index < len(args.chat_template) else None
    if positional and named:
        raise ValueError(f"{given!r} is given a chat template twice: --chat-template "
                         f"{positional} and --chat-template-for ...={named}")
    return positional or named


def _on_demand(args: argparse.Namespace, store, templates: dict[str, str]):
    """What attaches models loaded on request to the coordinator (None without
    --load-on-request); a ValueError for bounds without it, or without a launcher."""
    from coordinator.model_budget import ModelBudget, parse_size
    from coordinator.worker_supervisor import channel_fd

    bounds = args.max_loaded_models is not None or args.model_memory_budget is not None
    if not args.load_on_request:
        if bounds:
            raise ValueError("--max-loaded-models and --model-memory-budget bound the models "
                             "loaded on request: give --load-on-request too")
        return None
    fd = channel_fd()
    if fd is None:
        raise ValueError("--load-on-request needs the launcher that supervises the workers "
                         "(tandem serve --load-on-request): $TANDEM_SUPERVISOR_FD is not set")
    budget = ModelBudget(args.max_loaded_models, parse_size(args.model_memory_budget)
                         if args.model_memory_budget is not None else None)

    def attach(coordinator) -> None:
        from coordinator.on_demand import OnDemandModels
        from coordinator.worker_supervisor import SupervisorChannel

        coordinator.on_demand = OnDemandModels(coordinator, SupervisorChannel(fd), budget, store,
                                               args.model_start_timeout, templates=templates)
        logging.getLogger("coordinator").info(
            "models the stores hold load on request (budget: %s)", budget.describe())

    return attach


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    watch_launcher()  # TANDEM_LIFELINE_FD: end with the launcher that started us
    try:
        setup_logging(args.log_level, args.log_format)
        setup_tracing("tandem-coordinator", endpoint_from(args.otlp_traces_endpoint, os.environ),
                      protocol_from(args.otlp_traces_protocol, os.environ))
        from coordinator.model import load_from_store
        from coordinator.server import serve
        from common.model_store import default_store

        config = CoordinatorConfig(
            host=args.host, port=args.port, registry_host=args.registry_host,
            registry_port=args.registry_port, grpc_host=args.grpc_host,
            grpc_port=args.grpc_port, max_body_bytes=args.max_body_bytes,
            max_blob_bytes=args.max_blob_bytes,
            max_messages=args.max_messages, max_streams=args.max_streams,
            **{name: getattr(args, name) for _, name, _ in CONNECTION_FLAGS},
            prefill_threshold=args.prefill_threshold,
            chunk_size=args.chunk_size, local_chunk_size=args.local_chunk_size, max_queue=args.max_queue,
            local_prefill_max_stall_s=args.local_prefill_max_stall_ms / 1e3,
            max_running_per_worker=args.max_running_per_worker,
            queue_timeout_s=args.queue_timeout, load_timeout_s=args.load_timeout,
            keep_alive_s=_default_keep_alive(),
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_misses=args.heartbeat_misses, prefill_timeout_s=args.prefill_timeout,
            token_timeout_s=args.token_timeout, access_log=args.access_log,
            internal_api_from=tuple(args.internal_api_from),
            cluster_auth=auth_from_args(args),
            api_tls=api_tls_from(args.api_tls_cert, args.api_tls_key),
            response_cache=(ResponseCacheConfig.parse(args.response_cache)
                            if args.response_cache else None),
            api_key=os.environ.get("TANDEM_API_KEY", "").strip() or None,
            tenant_keys=tuple(read_keys_file(keys_file).items()) if (
                keys_file := os.environ.get("TANDEM_API_KEYS_FILE", "").strip()) else (),
            allowed_hosts=_allowed_hosts(args.allowed_hosts),
            allowed_origins=tuple(o.strip() for o in _env("OLLAMA_ORIGINS").split(",")
                                  if o.strip()))
        for flag, given in (("--model-name", args.model_name),
                            ("--chat-template", args.chat_template)):
            if len(given) > len(args.model):
                raise ValueError(f"{len(given)} {flag} for {len(args.model)} --model: give "
                                 "at most one per model")
        store = default_store()
        templates = templates_by_model(args.chat_template_for)
        check_templates_served(templates, [*args.model, *args.model_name], args.load_on_request)
        models = [load_from_store(
            store, given, args.model_name[i] if i < len(args.model_name) else given,
            _template_of(i, given, args, templates), logging.getLogger("coordinator").warning)
            for i, given in enumerate(args.model)]
        from coordinator.model_catalog import ModelCatalog

        models = ModelCatalog(models)  # refuses one file twice, or one name for two models
        embedder = config.response_cache.embed_model if config.response_cache else None
        if embedder is not None and not args.load_on_request and models.find(embedder) is None:
            raise ValueError(f"--response-cache: the embedding model {embedder!r} is not served; "
                             f"serve it beside the chat models (another --model), or load "
                             f"models on request")
        attach = _on_demand(args, store, templates)
    except (TandemError, ValueError) as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    logging.getLogger("coordinator").info(
        "client APIs %s; browser origins allowed besides Ollama's defaults: %s",
        (f"require an API key ({len(config.api_keys().tenants)} tenant(s), each with its own "
         "prefix cache)") if config.api_keys() else "are open (no API key)",
        ", ".join(config.allowed_origins) or "none")
    logging.getLogger("coordinator").info(
        "HTTP Host names served besides localhost and IP addresses: %s",
        ", ".join((config.host, *config.allowed_hosts)))
    logging.getLogger("coordinator").info(
        "client APIs: %s", f"TLS ({config.api_tls.cert})" if config.api_tls else "plaintext")
    logging.getLogger("coordinator").info("internal plane: %s", config.cluster_auth.describe())
    if not config.cluster_auth.secret and not is_loopback(config.registry_host):
        logging.getLogger("coordinator").warning(
            "the Registry listens on %s without a cluster secret: anyone who reaches it can "
            "register as a worker and receive users' prompts (set $TANDEM_CLUSTER_SECRET or "
            "--cluster-secret-file on every process)", config.registry_host)
    serve(config, models, store, attach)
    return 0


if __name__ == "__main__":
    sys.exit(main())
