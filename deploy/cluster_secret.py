"""The cluster secret every launcher hands the processes it starts (common/cluster_auth.py).

    secret, made = cluster_secret(os.environ)   # the operator's $TANDEM_CLUSTER_SECRET, else a
                                                #   fresh random one (made=True)
    write_secret_file(state_dir / SECRET_FILE, secret)   # 0600, for workers started later

Who uses it, and how the secret travels (always in a process's environment, never on argv:
`ps` shows command lines to every user of a host, /proc/PID/environ only to its owner):
    tandem serve        every process it starts (deploy/local.py, ProcessSpec.env)
    tandem launch       local and command-prefix hosts: ProcessSpec.env; SSH hosts: one line on
                        the ssh client's stdin, read by the remote shell's `read` builtin
                        (deploy/hosts.py), so no command line on either side holds it
    Ray launcher        the actor's Popen env (deploy/ray_launcher.py)

Off loopback, a launcher refuses to start an internal plane without a secret unless the operator
says `insecure_internal_plane` (INSECURE_WARNING is then logged at start, and the coordinator
logs its own warning when its Registry listens off loopback without one).
Torch- and grpc-free: the CLI imports it at start-up.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

ENV_SECRET = "TANDEM_CLUSTER_SECRET"  # the variable common/cluster_auth.py reads
SECRET_FILE = "cluster-secret"  # in a launch's state folder
INSECURE_WARNING = ("WARNING: the internal plane is open (--insecure-internal-plane): anyone who "
                    "reaches the Registry port can register as a worker and receive users' "
                    "prompts, and anyone who reaches a worker can call its Generate")


def cluster_secret(env: Mapping[str, str]) -> tuple[str, bool]:
    """(the secret, whether it was made here): $TANDEM_CLUSTER_SECRET when the operator set
    it, else 32 random bytes as hex (64 characters; common/cluster_auth.py wants 16 bytes)."""
    given = env.get(ENV_SECRET, "").strip()
    return (given, False) if given else (secrets.token_hex(32), True)


def write_secret_file(path: Path, secret: str) -> Path:
    """Write `secret` to `path`, readable by its owner only (created 0600, never wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path
