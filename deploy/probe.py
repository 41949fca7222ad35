"""`python -m deploy.probe --model M [--model M2 ...] [--listen ADDR:PORT ...] [--cluster-secret-file F --tls-* F]`:
run on each host before a launch.

Prints one JSON object: whether each model resolves in this host's own store (and its
fingerprint, which must be the same on every host; `models`, in --model order, and `model`,
the first's, as probes before several models answered), which of the given addresses cannot be
listened on (port in use, or an address this host does not have), and whether the internal
plane's files (the [security] paths, as this host sees them) exist and hold what the roles will
ask of them: the same start-up check a role makes (common/cluster_auth.py), made before any
role starts. The secret itself is read here but never printed. Exits 0 whenever it could
answer; the launcher judges the answer. Torch-free, so it answers in well under a second.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys


def check_model(name: str) -> dict:
    from common.errors import TandemError
    from common.model_files import load_config
    from common.model_identity import model_fingerprint
    from common.model_store import default_store

    try:
        # As the roles resolve it (worker/node_server.py): Ollama's store and the Hugging Face
        # cache of this host included.
        path = default_store().resolve(name)
        config = load_config(path)
        return {"path": str(path), "fingerprint": model_fingerprint(path, config)}
    except (TandemError, OSError, ValueError) as exc:
        return {"error": str(exc)}


def check_listen(address: str, port: int) -> str | None:
    """Why nothing could listen on address:port here, or None."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            s.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is in use on {address}"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"address {address} does not belong to this host"
            return f"cannot listen on {address}:{port}: {exc.strerror}"
    return None


def check_auth(args: argparse.Namespace) -> str | None:
    """Why the roles' --cluster-secret-file / --tls-* files would not do here, or None."""
    from common.cluster_auth import auth_from_args

    try:
        auth_from_args(args)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    from common.cluster_auth import add_auth_args

    p = argparse.ArgumentParser(prog="python -m deploy.probe")
    p.add_argument("--model", required=True, action="append")
    p.add_argument("--listen", action="append", default=[], metavar="ADDR:PORT")
    add_auth_args(p)  # the roles' own flags, checked as the roles will check them
    args = p.parse_args(argv)
    busy = []
    for item in args.listen:
        address, _, port = item.rpartition(":")
        problem = check_listen(address.strip("[]"), int(port))
        if problem:
            busy.append(problem)
    models = [check_model(m) for m in args.model]
    print(json.dumps({"hostname": socket.gethostname(), "model": models[0], "models": models,
                      "listen": busy, "auth": check_auth(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
