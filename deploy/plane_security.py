"""What `tandem launch` secures a topology's internal plane with, decided before anything starts
(common/cluster_auth.py says what the processes do with it):

    secret, made = launch_secret(topology, os.environ)  # None: [security] names a file, or
                                                        #   an insecure plane without one
    check_internal_plane(topology, secret)  # TopologyError: open off loopback, not asked for
    tls = launch_tls(topology, state_dir)   # off loopback without tls_* files: a CA, a
                                            #   certificate per host (deploy/cluster_ca.py)

deploy/launch.py hands both to every role (plan_launch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from deploy.cluster_ca import Issued, OpenSSLError, make_cluster_tls
from deploy.cluster_secret import ENV_SECRET, cluster_secret
from deploy.topology import ClusterTopology, TopologyError


def launch_secret(t: ClusterTopology, env: Mapping[str, str]) -> tuple[str | None, bool]:
    """(the secret `launch` hands every process, whether it was made here): None where
    [security] names a file (each host reads its own) or, without $TANDEM_CLUSTER_SECRET, where
    the plane is declared insecure; else the operator's $TANDEM_CLUSTER_SECRET, else a new one
    (kept in `state_dir/cluster-secret`, 0600, for workers started later)."""
    if t.secret_file or (t.insecure_internal_plane and not env.get(ENV_SECRET, "").strip()):
        return None, False
    return cluster_secret(env)


def check_internal_plane(t: ClusterTopology, secret: str | None) -> None:
    """TopologyError when roles listen off loopback with an open internal plane and the
    operator did not ask for one: anyone reaching the Registry could register as a worker and
    receive users' prompts."""
    if t.off_loopback and not (secret or t.secret_file or t.insecure_internal_plane):
        raise TopologyError(
            f"{t.source}: refusing to start an internal plane that listens off loopback without "
            f"a cluster secret (anyone who reaches the Registry could register as a worker and "
            f"receive users' prompts): name [security] cluster_secret_file, set "
            f"${ENV_SECRET}, let `tandem launch` make one, or accept an open plane with "
            f"[security] insecure_internal_plane = true / --insecure-internal-plane")


def launch_tls(t: ClusterTopology, state_dir: Path) -> dict[str, Issued] | None:
    """Mutual TLS for a topology that listens off loopback and names no [security] tls_* files
    (nor insecure_internal_plane): a new CA in `state_dir/tls` (files 0600) and a certificate
    per host for its address, by host name. None where none is needed; TopologyError when
    openssl cannot make them."""
    if not t.off_loopback or t.insecure_internal_plane or "--tls-cert" in t.auth_args:
        return None
    try:
        return make_cluster_tls(state_dir / "tls", {h.name: h.address for h in t.hosts})
    except OpenSSLError as exc:
        raise TopologyError(f"{t.source}: cannot make the cluster's TLS certificates ({exc}); "
                            f"name [security] tls_cert/tls_key/tls_ca, or accept a plaintext "
                            f"plane with insecure_internal_plane") from None
