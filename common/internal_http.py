"""The coordinator's internal HTTP routes (`/internal/*`) and how a launcher calls them.

The public HTTP port serves them, so the port alone proves nothing: a reverse proxy on the
coordinator's host makes every outside client look local. With a cluster secret each call
carries the same proof as an internal gRPC call (common/cluster_auth.py), in the header
`x-tandem-proof`, made for the method name "GET /internal/workers" and an empty body: one proof
opens one call (its nonce is remembered), and a client without the secret cannot make one.
Without a secret (an open plane) the coordinator falls back to serving clients on its host or
in --internal-api-from (coordinator/ops_routes.py), which a local proxy defeats: hence the
secret by default.
"""

from __future__ import annotations

import json
import ssl
import urllib.request

from common.cluster_auth import PROOF_HEADER, ClusterAuth

WORKERS_PATH = "/internal/workers"


def internal_method(path: str) -> str:
    """What a proof for an internal HTTP route names (no gRPC method looks like it)."""
    return f"GET {path}"


def internal_headers(secret: str | bytes | None, path: str = WORKERS_PATH) -> dict[str, str]:
    """The headers of one call to `path`: a fresh proof with a secret, none without."""
    if not secret:
        return {}
    # As ClusterAuth.from_sources reads $TANDEM_CLUSTER_SECRET: stripped, UTF-8.
    auth = ClusterAuth(secret.strip().encode() if isinstance(secret, str) else secret.strip())
    return {PROOF_HEADER: auth.proof(internal_method(path))}


def get_internal(base_url: str, secret: str | bytes | None, path: str = WORKERS_PATH,
                 timeout: float = 10.0) -> dict:
    """GET an internal route's JSON. Over https the certificate is not checked: the caller is
    a launcher polling a coordinator it started, whose certificate names the clients' host,
    maybe not this address; the proof, not the channel, is what the coordinator checks."""
    request = urllib.request.Request(base_url + path, headers=internal_headers(secret, path))
    context = ssl._create_unverified_context() if base_url.startswith("https") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
        return json.loads(r.read())
