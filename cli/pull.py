"""`tandem pull [MODEL]`: fetch a model into the cache (the default model without a name)."""

from __future__ import annotations

import argparse

from cli.common_args import DEFAULT_MODEL, pull, store


def register(subparsers) -> None:
    p = subparsers.add_parser("pull", help="download a model into the cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"model name (default {DEFAULT_MODEL})")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    path = pull(store(), args.model)
    print(f"{args.model}: {path}")
    return 0
