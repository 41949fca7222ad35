"""How every tandem gRPC server is built and bound (worker nodes, the coordinator's registry
and client API, the gRPC KV receiver).

- `grpc.so_reuseport` off: grpc turns SO_REUSEPORT on by default, so a second process could
  bind a port already taken without an error and the kernel would split the clients between
  the two at random. Off, a taken port is a start-up error.
- RejectMalformed first among the interceptors (grpc_guard.py).
- `bind` turns grpc's failed bind (a RuntimeError, or port 0) into an OSError that names the
  address and what was to be served there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from common.grpc_guard import guarded

SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def new_server(options: Sequence[tuple[str, object]] = (),
               interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None
               ) -> grpc.aio.Server:
    return grpc.aio.server(options=[*SERVER_OPTIONS, *options],
                           interceptors=guarded(list(interceptors or ())))


def bind(add_port: Callable[[str], int], address: str, what: str) -> int:
    """`add_port(address)` (a server's add_insecure_port, or a TLS variant) -> the bound port;
    OSError naming the address when it cannot be bound (taken, or not this host's)."""
    try:
        port = add_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot serve {what} on {address}: the port is in use by another "
                      "process, or the address is not one of this host's")
    return port
