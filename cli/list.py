"""`tandem list` (`ls`): the running server's models, or the cache's without a server."""

from __future__ import annotations

import argparse

from cli.common_args import add_server_args, server, store, table


def register(subparsers) -> None:
    p = subparsers.add_parser("list", aliases=["ls"], help="list models (the server's, or cached)")
    add_server_args(p)
    p.set_defaults(func=cmd_list)


def cmd_list(args: argparse.Namespace) -> int:
    running = server(args)
    if running.running():
        table([[m["name"], m["digest"][:16], f"{m['size'] / 1e6:.1f} MB", m["modified_at"][:19]]
               for m in running.tags()], ["NAME", "ID", "SIZE", "MODIFIED"])
        return 0
    entries = store().list()
    print(f"{'NAME':32} {'SIZE':>10}  {'DIGEST':14} MODIFIED")
    for e in entries:
        print(f"{e.name:32} {e.size / 1e6:8.1f}MB  {e.sha256[:12]:14} {e.modified_at:%Y-%m-%d %H:%M}")
    return 0
