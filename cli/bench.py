"""`tandem bench`: the load generator (cli/load_generator.py) against a tandem, Ollama or
OpenAI server."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from cli.load_generator import add_arguments  # torch-free

    p = subparsers.add_parser("bench", help="serving benchmark (load generator)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from cli.load_generator import run_from_args

    return run_from_args(args)
