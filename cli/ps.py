"""`tandem ps`: the models a running server has loaded."""

from __future__ import annotations

import argparse

from cli.common_args import add_server_args, server, table
from common.errors import TandemError


def register(subparsers) -> None:
    p = subparsers.add_parser("ps", help="models a running server has loaded")
    add_server_args(p)
    p.set_defaults(func=cmd_ps)


def cmd_ps(args: argparse.Namespace) -> int:
    running = server(args)
    if not running.running():
        raise TandemError(f"no tandem server is running at {running.url} (start one with "
                          "`tandem serve`)")
    table([[m["name"], m["digest"][:16], f"{m['size'] / 1e6:.1f} MB",
            f"{m.get('context_length', '')}", "Forever"] for m in running.ps()],
          ["NAME", "ID", "SIZE", "CONTEXT", "UNTIL"])
    return 0
