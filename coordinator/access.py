"""Who may call the client APIs: one API key, the names the server answers to (Host), and the
browser origins allowed (CORS).

HTTP, as two ASGI middlewares around the FastAPI app (`install_http_access`):

    request ─> CORSMiddleware ─> AccessGuard ─> routes
               │                 ├─ a Host that is not one of this server's names: 403
               │                 ├─ an Origin not allowed: 403
               │                 └─ no or a wrong `Authorization: Bearer KEY`: 401
               └─ a preflight (OPTIONS + Access-Control-Request-Method) is answered here,
                  without the key (browsers never send credentials on one); every answer to an
                  allowed origin carries Access-Control-Allow-Origin, 401s and 403s included,
                  so that a page can read why it was refused

Origins follow Ollama (envconfig's AllowedOrigins, served through gin-contrib/cors with
wildcards): OLLAMA_ORIGINS' comma-separated entries, then http(s)://localhost, 127.0.0.1 and
0.0.0.0 with or without any port, app://*, file://*, tauri://*, vscode-webview://*,
vscode-file://*. In an entry `*` matches any text; "*" alone allows every origin. As in Ollama,
a request whose Origin is not allowed is refused (403), not merely left without CORS headers: a
page of another site could otherwise make this server run a CORS-"simple" POST (text/plain
body) whose answer it cannot read. Requests without an Origin (curl, the SDKs) pass. An Origin
is never compared with the Host: under DNS rebinding both name the attacker's domain.

Host (DNS rebinding, the class of Ollama's CVE-2024-28224): a page of attacker.example whose
name the attacker makes resolve to 127.0.0.1 is same-origin with this server in the browser's
eyes, so neither CORS nor the Origin check stops it; only its Host header, `attacker.example`,
tells it apart. A request is served when its Host (port aside) is absent, an IP address (no DNS
answer can forge one), `localhost` or a `*.localhost` name (always loopback, RFC 6761), or one
of `Hosts`' names: the bind host, OLLAMA_HOST's, the machine's own, and --allowed-hosts /
TANDEM_ALLOWED_HOSTS (`*.example.com` matches its subdomains; `*` alone allows every Host:
for a server behind a proxy that checks names itself). Any other Host is a 403.

The key is compared in constant time: hmac.compare_digest over SHA-256 digests, so that neither
its bytes nor its length show in the timing. Open without it: `/` (GET and HEAD: the health
check of load balancers and of the Kubernetes manifests), /health, /metrics (Prometheus
scrapers, as vLLM serves it), /ui (the built-in page; /ui/data, what it polls, needs the
key), /internal/workers (behind the cluster's proof with a secret, else only for peers on
this host or in --internal-api-from; polled by the launchers), and gRPC's grpc.health.v1
(Kubernetes' grpc probes cannot send metadata). On the gRPC API the key is the metadata
`authorization: Bearer KEY`; without it a call ends UNAUTHENTICATED before its method runs
(ApiKeyInterceptor).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

import grpc
from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.http_errors import error_response
from common.cluster_auth import refusal_handler
from coordinator.model import shown
from coordinator.tenants import ApiKeys, cache_salt

OLLAMA_DEFAULT_ORIGINS = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for scheme in ("http", "https") for port in ("", ":*")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
# Served without the key: Ollama's liveness page, the launchers' worker list (behind the
# cluster proof instead: coordinator/ops_routes.py), /health for load balancers and Kubernetes
# probes (it says only whether a worker serves), and /metrics for Prometheus (vLLM's choice:
# the key protects the API routes; the counters name no prompt and no key), and the page at
# /ui (static, it asks for the key and sends it with its calls: coordinator/ui_routes.py).
OPEN_PATHS = frozenset({"/", "/internal/workers", "/health", "/metrics", "/ui"})
OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"
VERSION_HEADER = "X-Tandem-Version"
# gin-contrib/cors' defaults, as Ollama serves them.
CORS_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
HTTP_KEY_HINT = "send the header 'Authorization: Bearer KEY' with the server's API key"
GRPC_KEY_HINT = "send the metadata 'authorization: Bearer KEY' with the server's API key"


class Origins:
    """The origins a browser page may call from: Ollama's defaults and `extra`."""

    def __init__(self, extra: Sequence[str] = ()) -> None:
        patterns = [*extra, *OLLAMA_DEFAULT_ORIGINS]
        self.any = "*" in patterns
        self.regex = "|".join("".join(".*" if part == "*" else re.escape(part)
                                      for part in re.split(r"(\*)", p)) for p in patterns)
        self._compiled = re.compile(self.regex, re.IGNORECASE)  # schemes and hosts ignore case

    def allows(self, origin: str) -> bool:
        return self.any or self._compiled.fullmatch(origin) is not None


class Hosts:
    """The names a request's Host header may carry (see the module docstring)."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        names = {n.lower().rstrip(".") for n in names}
        self.any = "*" in names
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".example.com"
        self.names = {n for n in names if not n.startswith("*")}

    def allows(self, host: str | None) -> bool:
        if self.any or not host:
            return True
        name = host_name(host)
        if name == "localhost" or name.endswith(".localhost") or name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return name.endswith(self.suffixes) if self.suffixes else False


def host_name(host: str) -> str:
    """A Host header's name without its port, lower case, with no trailing dot:
    `[::1]:11434` -> `::1`, `LocalHost.:80` -> `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


class AccessGuard:
    """Pure ASGI (no BaseHTTPMiddleware: streams pass through untouched). Also stamps every
    answer with tandem's own version, since /api/version reports the Ollama version matched."""

    def __init__(self, app: ASGIApp, *, key: ApiKeys | None, hosts: Hosts, origins: Origins,
                 version: str) -> None:
        self.app, self.key, self.hosts, self.origins = app, key, hosts, origins
        self.version = version

    def _admit_tenant(self, scope: Scope, headers: Headers) -> bool:
        """Whether the request carries a key; its tenant is recorded for the handlers."""
        tenant = self.key.tenant(headers.get("authorization"))
        if tenant is None:
            return False
        scope.setdefault("state", {})["tenant"] = tenant
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[VERSION_HEADER] = self.version
            await send(message)

        headers = Headers(scope=scope)
        path = scope["path"]
        origin, host = headers.get("origin"), headers.get("host")
        if not self.hosts.allows(host):
            refusal = error_response(path, 403, f"host {shown(host_name(host))} is not one of "
                                                "this server's names: the server's "
                                                "--allowed-hosts (TANDEM_ALLOWED_HOSTS) must "
                                                "list it")
        elif origin is not None and not self.origins.allows(origin):
            refusal = error_response(path, 403, f"origin {shown(origin)} is not allowed: the "
                                                "server's OLLAMA_ORIGINS must list it")
        elif (self.key is not None and path not in OPEN_PATHS
              and not self._admit_tenant(scope, headers)):
            what = "invalid" if "authorization" in headers else "missing"
            refusal = error_response(path, 401, f"{what} API key: {HTTP_KEY_HINT}",
                                     headers={"WWW-Authenticate": 'Bearer realm="tandem"'},
                                     code="invalid_api_key")
        else:
            await self.app(scope, receive, stamped)
            return
        await refusal(scope, receive, stamped)


def tenant_of(scope: Scope) -> str:
    """The tenant AccessGuard admitted the request as ("" on a server without keys)."""
    return scope.get("state", {}).get("tenant", "")


def request_salt(request: HTTPConnection, own: str | None = None) -> bytes:
    """The prefix-cache salt of an HTTP request: its tenant's, split by its own `cache_salt`."""
    return cache_salt(tenant_of(request.scope), own)


def grpc_salt(keys: ApiKeys | None, context: grpc.aio.ServicerContext) -> bytes:
    """The prefix-cache salt of a gRPC call, from the key in its metadata."""
    if keys is None:
        return b""
    metadata = dict(context.invocation_metadata() or ())
    return cache_salt(keys.tenant(metadata.get("authorization")) or "")


def install_http_access(app: FastAPI, keys: ApiKeys | None, host_names: Sequence[str],
                        extra_origins: Sequence[str], version: str) -> None:
    origins = Origins(extra_origins)
    # Starlette runs the middleware added last outermost: CORS answers preflights first.
    app.add_middleware(AccessGuard, key=keys, hosts=Hosts(host_names), origins=origins,
                       version=version)
    app.add_middleware(CORSMiddleware, allow_origins=("*",) if origins.any else (),
                       allow_origin_regex=None if origins.any else origins.regex,
                       allow_methods=CORS_METHODS, allow_headers=("*",),
                       # A page may read the id its request was logged under.
                       expose_headers=("X-Request-Id",),
                       # A page the operator allowed may reach a server on a private network
                       # (Chrome's Private Network Access preflight).
                       allow_private_network=True)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without the key UNAUTHENTICATED, except the health service's."""

    def __init__(self, key: ApiKeys) -> None:
        self.key = key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.key.matches(metadata.get("authorization")):
            return handler
        what = "invalid" if "authorization" in metadata else "missing"
        return refusal_handler(handler, f"{what} API key: {GRPC_KEY_HINT}")
