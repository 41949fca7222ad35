"""The coordinator's settings: one frozen dataclass, validated at construction.

Only `coordinator/__main__.py` builds it from flags; nothing deeper reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    max_queue: int = 64  # requests waiting for a slot; more are refused with 503
    max_running_per_worker: int = 32  # concurrent requests per decode/colocated worker
    queue_timeout_s: float = 30.0  # longest wait for a slot before a 503
    heartbeat_interval_s: float = 1.0  # told to workers in RegisterResponse
    heartbeat_misses: int = 3  # intervals without a heartbeat before a worker counts as dead
    # Deadlines (seconds) of the RPCs to workers.
    reserve_timeout_s: float = 30.0  # Generate(remote_prefill) until its `reserved` event
    prefill_timeout_s: float = 300.0  # one Prefill call (queueing + compute on the worker)
    control_timeout_s: float = 10.0  # StartDecode and Status
    token_timeout_s: float = 300.0  # longest gap between two events of a Generate stream
    request_timeout_s: float = 3600.0  # whole Generate stream
    retry_after_s: int = 1  # Retry-After header of a 503
    # Limits on what one client may ask (each refusal is a one-line error naming the limit).
    max_body_bytes: int = 4 << 20  # HTTP request body (413 above)
    max_messages: int = 1024  # messages in one chat request
    max_streams: int = 512  # requests open at once, queued or running, on every API (429 above)
    # GET /internal/workers (worker addresses, KV endpoints, the model fingerprint) is served to
    # clients on this host only, and to these networks (CIDR, e.g. "10.0.0.0/8") if given.
    internal_api_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("prefill_threshold", "registry_port", "grpc_port"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")
        for name in ("chunk_size", "local_chunk_size", "max_running_per_worker", "heartbeat_misses", "retry_after_s",
                     "max_body_bytes", "max_messages", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        import ipaddress  # noqa: PLC0415

        for network in self.internal_api_from:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"internal_api_from: {network!r} is not a network "
                                 "(CIDR such as 10.0.0.0/8, or an address)") from None
        for name in ("queue_timeout_s", "heartbeat_interval_s", "reserve_timeout_s",
                     "prefill_timeout_s", "control_timeout_s", "token_timeout_s",
                     "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def heartbeat_deadline_s(self) -> float:
        """Silence after which a worker is dead."""
        return self.heartbeat_interval_s * self.heartbeat_misses
