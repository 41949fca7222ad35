"""`tandem`: the command line. One module per subcommand, each with `register(subparsers)`
that adds its parser and sets its handler; this module only builds the top parser from them
and dispatches. Shared pieces (the model store, the server's address) are cli/common_args.py.

    tandem pull smollm2                 fetch the default model into the cache     cli/pull.py
    tandem list                         the server's models, or the cache's        cli/list.py
    tandem ps                           models a running server has loaded         cli/ps.py
    tandem show MODEL                   a model's details                          cli/show.py
    tandem bench [opts]                 load generator against a server            cli/bench.py
    tandem run MODEL [PROMPT] [opts]    generate, through the server or in-process cli/run.py
    tandem serve [opts]                 coordinator + workers on this host         cli/serve.py
    tandem launch TOPOLOGY.toml         a multi-host topology                      cli/launch.py
    tandem plan [opts]                  size a cluster for a load and an SLO       cli/plan.py
    tandem --version                    the installed package's version

The server is found at --host, else $OLLAMA_HOST, else 127.0.0.1:11434 (as ollama's CLI), and
is sent $TANDEM_API_KEY, if set, as `Authorization: Bearer KEY`. An https:// host's certificate
is checked against --ca-file (else $TANDEM_CA_FILE, else the system's CAs).
"""

from __future__ import annotations

import argparse
import sys

import cli.bench
import cli.launch
import cli.list
import cli.plan
import cli.ps
import cli.pull
import cli.run
import cli.serve
import cli.show
from cli.common_args import VersionAction, dispatch

# In the order `tandem --help` lists them.
SUBCOMMANDS = (cli.pull, cli.list, cli.ps, cli.show, cli.bench, cli.run, cli.serve, cli.launch, cli.plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
