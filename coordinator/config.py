"""The coordinator's settings: one frozen dataclass, validated at construction.

Only `coordinator/__main__.py` builds it from flags; nothing deeper reads the environment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from coordinator.tenants import DEFAULT_TENANT, ApiKeys
from coordinator.api_tls import ApiTLS
from coordinator.response_cache_config import ResponseCacheConfig
from common.cluster_auth import ClusterAuth

# The longest keep_alive: a year. Longer ones are refused (a 400 naming keep_alive) rather
# than stored: an expiry tens of thousands of years away is no date /api/ps can write, for
# anyone. Forever is a negative keep_alive (math.inf here).
MAX_KEEP_ALIVE_S = 365 * 24 * 3600.0


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "127.0.0.1"
    port: int = 11434  # HTTP (Ollama's default port)
    registry_host: str = "127.0.0.1"  # Registry gRPC service, where workers register
    registry_port: int = 0  # 0 = any free port
    grpc_host: str = "127.0.0.1"  # the client-facing gRPC API (proto/tandem.proto)
    grpc_port: int = 0  # 0 = any free port (logged); `tandem serve` passes 50051
    # Conditional disaggregation: prompts of at most this many tokens may be prefilled on the
    # decode worker itself when it has spare token budget (placement.py).
    prefill_threshold: int = 64
    # Per-forward-pass token budget assumed for a worker that does not report its own
    # max_num_batched_tokens; the launcher passes the same value to the workers.
    chunk_size: int = 512
    # The chunk plan, sent with each request: prefill chunks on a prefill worker are at most
    # chunk_size tokens; a prompt prefilled on a decode worker goes in chunks of at most
    # local_chunk_size, so each step of that worker's decode batch grows by little (ITL).
    local_chunk_size: int = 64
    # A short prompt is prefilled on a busy decode worker only if that costs its running
    # streams at most this much extra time (its tokens at the worker's measured cost per
    # prompt token, placement.local_prefill_stall_fits); an idle decode worker has no stream
    # to stall. 0: never on a busy one.
    local_prefill_max_stall_s: float = 0.1
    max_queue: int = 64  # requests waiting for a slot; more are refused with 503
    max_running_per_worker: int = 32  # concurrent requests per decode/colocated worker
    queue_timeout_s: float = 30.0  # longest wait for a slot before a 503
    # Longest wait of a request for a live decode worker before a 503. Workers register only
    # once their model is loaded, so this is a wait for a model load (a worker starting up, or
    # restarted after a crash): the request's Ollama load_duration. 0 = refuse at once.
    load_timeout_s: float = 30.0
    # How long the model stays loaded after a request that names no keep_alive (Ollama's
    # default 5m; OLLAMA_KEEP_ALIVE sets it): then the workers drop its weights until the next
    # request (coordinator/residency.py). math.inf = forever.
    keep_alive_s: float = 300.0
    heartbeat_interval_s: float = 1.0  # told to workers in RegisterResponse
    heartbeat_misses: int = 3  # intervals without a heartbeat before a worker counts as dead
    # Deadlines (seconds) of the RPCs to workers.
    prefill_timeout_s: float = 300.0  # one Prefill call (queueing + compute on the worker)
    control_timeout_s: float = 10.0  # Status
    token_timeout_s: float = 300.0  # longest gap between two events of a Generate stream
    request_timeout_s: float = 3600.0  # whole Generate stream
    # Times one request may move to other workers after the one serving it died (migration:
    # re-placed with the prompt plus the tokens so far). 0 = a dead worker fails its streams.
    max_migrations: int = 2
    # One log line per HTTP request (method, path, status, duration, request id; never the
    # body): coordinator/access_log.py.
    access_log: bool = True
    retry_after_s: int = 1  # Retry-After header of a 503
    # Limits on what one client may ask (each refusal is a one-line error naming the limit).
    max_body_bytes: int = 4 << 20  # HTTP request body (413 above)
    # A blob uploaded to /api/blobs (a model file, streamed to disk, never held in memory;
    # max_body_bytes does not apply to it): 413 above.
    max_blob_bytes: int = 256 << 30
    max_messages: int = 1024  # messages in one chat request
    max_streams: int = 512  # requests open at once, queued or running, on every API (429 above)
    # HTTP connections (coordinator/connection_limits.py): a socket that holds a descriptor
    # without a request is closed; one past a count is a 503 and closed at once.
    header_timeout_s: float = 10.0  # a request head must arrive whole within this once awaited
    body_timeout_s: float = 30.0  # longest silence while a request body is being read
    idle_timeout_s: float = 5.0  # keep-alive connection idle between requests (uvicorn's 5 s)
    max_connections: int = 4096  # open HTTP connections in all
    # from one client address; >= max_streams, so that one host can fill the server
    max_connections_per_client: int = 1024
    # GET /internal/workers (worker addresses, KV endpoints, the model fingerprint): with a
    # cluster secret, to calls with the cluster proof only (coordinator/ops_routes.py); without
    # one, to clients on this host, and to these networks (CIDR, e.g. "10.0.0.0/8") if given.
    internal_api_from: tuple[str, ...] = ()
    # The key of the client APIs (coordinator/access.py): HTTP `Authorization: Bearer KEY` on
    # every route but `/`, /health, /metrics and /internal/workers, gRPC metadata `authorization: Bearer KEY` on
    # all but grpc.health.v1. None = no key. Read from TANDEM_API_KEY, never from a flag (ps
    # shows a command line); repr=False keeps it out of every log of this config.
    api_key: str | None = field(default=None, repr=False)
    # Named keys (coordinator/tenants.py): tenant name -> key, from an API keys file
    # (TANDEM_API_KEYS_FILE). Each key is accepted like api_key (which is tenant "default"),
    # and its tenant's prefix cache is its own.
    tenant_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Browser origins allowed besides Ollama's defaults (localhost, app://, ...): OLLAMA_ORIGINS'
    # entries, each an origin where `*` matches any text; "*" alone allows every origin.
    allowed_origins: tuple[str, ...] = ()
    # Names the HTTP API answers to in a request's Host header besides `host`, localhost and IP
    # addresses (coordinator/access.py: DNS rebinding): --allowed-hosts / TANDEM_ALLOWED_HOSTS,
    # OLLAMA_HOST's name and the machine's. "*.example.com" matches its subdomains; "*" alone
    # allows every Host (a bind of 0.0.0.0 behind a proxy that checks names itself).
    allowed_hosts: tuple[str, ...] = ()
    # The internal plane's credentials (common/cluster_auth.py): with a secret the Registry
    # refuses workers that cannot prove it and calls to workers carry our proof; with TLS
    # files the Registry and every channel to a worker are mutual TLS. Default: neither.
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth, repr=False)
    # TLS of the client APIs, HTTP and gRPC alike (coordinator/api_tls.py); None = plaintext.
    api_tls: ApiTLS | None = None
    # The response cache (coordinator/response_cache.py; --response-cache); None = off.
    response_cache: ResponseCacheConfig | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)
        for _, key in self.tenant_keys:
            check_api_key(key)
        for origin in self.allowed_origins:
            if not origin or any(c.isspace() for c in origin):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin "
                                 "(such as https://example.com or chrome-extension://*)")
        for name in self.allowed_hosts:
            if not re.fullmatch(r"\*|(\*\.)?[A-Za-z0-9_.-]+", name):
                raise ValueError(f"allowed_hosts: {name!r} is not a host name (such as "
                                 "tandem.example.com, *.example.com, or * for any)")
        for name in ("prefill_threshold", "registry_port", "grpc_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        for name in ("chunk_size", "local_chunk_size", "max_running_per_worker", "heartbeat_misses", "retry_after_s",
                     "max_body_bytes", "max_blob_bytes", "max_messages", "max_streams", "max_connections",
                     "max_connections_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        if not self.local_prefill_max_stall_s >= 0:  # also refuses nan
            raise ValueError(f"local_prefill_max_stall_s must be >= 0, got "
                             f"{self.local_prefill_max_stall_s!r}")
        import ipaddress  # noqa: PLC0415

        for network in self.internal_api_from:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"internal_api_from: {network!r} is not a network "
                                 "(CIDR such as 10.0.0.0/8, or an address)") from None
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations!r}")
        if not (0 <= self.keep_alive_s <= MAX_KEEP_ALIVE_S or self.keep_alive_s == math.inf):
            raise ValueError(f"keep_alive_s must be in 0..{MAX_KEEP_ALIVE_S:.0f} (a year), or math.inf = "
                             f"forever, got {self.keep_alive_s!r}")
        if not self.load_timeout_s >= 0:
            raise ValueError(f"load_timeout_s must be >= 0, got {self.load_timeout_s!r}")
        for name in ("queue_timeout_s", "heartbeat_interval_s",
                     "prefill_timeout_s", "control_timeout_s", "token_timeout_s",
                     "request_timeout_s", "header_timeout_s", "body_timeout_s",
                     "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    def api_keys(self) -> ApiKeys | None:
        """Every key the client APIs accept, by tenant; None = the APIs are open."""
        keys = dict(self.tenant_keys)
        if self.api_key is not None:
            keys.setdefault(DEFAULT_TENANT, self.api_key)
        return ApiKeys(keys) if keys else None

    @property
    def heartbeat_deadline_s(self) -> float:
        """Silence after which a worker is dead."""
        return self.heartbeat_interval_s * self.heartbeat_misses


def check_api_key(key: str) -> None:
    """A key a client can send as `Bearer KEY`: visible ASCII, no spaces. The message never
    shows the key."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("the API key (TANDEM_API_KEY) must be a non-empty string of visible "
                         "ASCII characters without spaces")
