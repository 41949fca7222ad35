"""What several `tandem` subcommands share: the model store, the running server's address
(--host, --ca-file), the --version action, tables, and how a handler's errors end the
process. The environment (TANDEM_HOME, OLLAMA_HOST, TANDEM_API_KEY, TANDEM_CA_FILE) is read
here and in the subcommand modules, nowhere deeper."""

from __future__ import annotations

import argparse
import os
import sys

from common.errors import TandemError
from common.model_store import ModelStore, default_store

DEFAULT_MODEL = "smollm2"


def store() -> ModelStore:
    return default_store()


def pull(model_store: ModelStore, name: str):
    """model_store.pull with progress bars on stderr (cli/pull_progress.py)."""
    from cli.pull_progress import PullBars

    with PullBars() as bars:
        return model_store.pull(name, progress=bars)


def resolve_or_pull(name: str):
    """The cached path of `name`, pulling it first when it is a known name or a Hugging Face
    repo (org/name[:TAG]) not yet cached."""
    model_store = store()
    try:
        return model_store.resolve(name)
    except TandemError:
        from_hub = model_store.hf is not None and model_store.hf.repo_dir(name) is not None
        if name not in model_store.known_names() and not from_hub:
            raise
        return pull(model_store, name)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """--host and --ca-file: where a subcommand finds the running server."""
    p.add_argument("--host", help="server address (default $OLLAMA_HOST or 127.0.0.1:11434)")
    p.add_argument("--ca-file", metavar="PEM", help="CA that signed an https:// server's "
                                                   "certificate (default $TANDEM_CA_FILE)")


def server(args: argparse.Namespace):
    """The server at --host, else $OLLAMA_HOST, else 127.0.0.1:11434, sent $TANDEM_API_KEY."""
    from deploy.remote import Server, base_url

    return Server(base_url(args.host or os.environ.get("OLLAMA_HOST")),
                  api_key=os.environ.get("TANDEM_API_KEY", "").strip() or None,
                  ca_file=args.ca_file or os.environ.get("TANDEM_CA_FILE", "").strip() or None)


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


class VersionAction(argparse.Action):
    """--version from the installed package's metadata, looked up only when asked; a source tree
    that was never installed has no version to print, which is an error, not a guess."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print tandem's version and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("tandem")
        except PackageNotFoundError:
            parser.exit(1, "Error: tandem is not installed (no package metadata), so it has no "
                           "version; pip install it\n")
        print(f"tandem {found}")  # stdout, as argparse's own "version" action
        parser.exit(0)


def dispatch(args: argparse.Namespace) -> int:
    """Run a parsed subcommand: a TandemError is one line on stderr and exit 1, Ctrl-C 130."""
    try:
        return args.func(args)
    except TandemError as exc:
        sys.stderr.write(f"Error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130

