"""The server's own routes, for operators, probes and launchers: /metrics (Prometheus),
/health and /version (vLLM's), /internal/workers (the table is coordinator/routes.py)."""

from __future__ import annotations

import ipaddress

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.cluster_auth import PROOF_HEADER
from common.internal_http import WORKERS_PATH, internal_method
from coordinator.http_errors import error_response
from coordinator.ollama_routes import tandem_version
from coordinator.registry import DECODE_ROLES
from coordinator.service import Coordinator


class OpsRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.internal_from = [ipaddress.ip_network(n, strict=False)
                              for n in coordinator.config.internal_api_from]

    async def metrics(self) -> Response:
        return Response(self.coordinator.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self) -> JSONResponse:
        """200 while every model served can be served end to end: a decode or colocated worker
        of it is live (it prefills too, so no prefill worker is needed); a 503 naming the
        models that cannot otherwise, for load balancers and readiness probes. A model that
        keep_alive unloaded is healthy: the next request reloads it."""
        c = self.coordinator
        live = c.registry.live_counts()
        per_model = {m.name: c.registry.live_counts(m.fingerprint) for m in c.models}
        body = {"model": c.model.name, "live_workers": live,
                "models": [{"name": name, "live_workers": counts}
                           for name, counts in per_model.items()]}
        down = [(name, counts) for name, counts in per_model.items()
                if not any(counts[role] for role in DECODE_ROLES)]
        if not down:
            return JSONResponse({"status": "ok", **body})
        reason = "; ".join(
            f"no live decode or colocated worker serves {name}"
            + (f" ({counts['prefill']} prefill worker(s) live, which cannot decode)"
               if counts["prefill"] else "") for name, counts in down)
        return JSONResponse({"status": "unavailable", "reason": reason, **body},
                            status_code=503)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": tandem_version()})

    # Worker addresses, KV endpoints and the model fingerprint a worker registers with: for the
    # launchers (deploy/local.py, deploy/launch.py, deploy/ray_launcher.py, the chaos suite and
    # the tests poll it). With a cluster secret only a call with a cluster proof is served
    # (common/internal_http.py): the peer's address proves nothing behind a local reverse proxy.
    # Without one (an open plane), clients on this host or in --internal-api-from. Every
    # refusal is a 403, counted in tandem_grpc_refused_calls_total{method="GET /internal/workers"}.
    async def workers(self, request: Request) -> JSONResponse:
        method = internal_method(WORKERS_PATH)
        auth = self.coordinator.config.cluster_auth
        if auth.secret:
            reason = auth.admit(method, request.headers.get(PROOF_HEADER), body=b"")
            if reason:
                auth.refused.add(method, reason)
                return error_response(request.url.path, 403,
                                      f"{WORKERS_PATH} needs the cluster's proof in the header "
                                      f"{PROOF_HEADER!r}: {reason}")
        elif not _internal_client(request, self.internal_from):
            auth.refused.add(method, "off this host")
            return error_response(request.url.path, 403,
                                  f"{WORKERS_PATH} is served only to clients on the "
                                  "coordinator's host (or in --internal-api-from) when the "
                                  "cluster has no secret")
        return JSONResponse(self.coordinator.workers_report())


def _internal_client(request: Request, networks: list) -> bool:
    """True for a loopback peer, a peer on this host, or one in `networks`.

    A peer whose address is the address it connected to is on this host: Linux routes a
    connection to one of its own addresses over loopback with that address as the source, and
    drops packets from outside that claim a local source address (a spoofed SYN could not
    complete the handshake anyway)."""
    if request.client is None:
        return False
    try:
        peer = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    if peer.is_loopback:
        return True
    server = request.scope.get("server")
    if server and server[0] == request.client.host:
        return True
    return any(peer in network for network in networks)

