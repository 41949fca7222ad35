"""`tandem launch TOPOLOGY.toml` and `tandem launch --down TOPOLOGY.toml`.

cli/main.py mounts this subcommand with `register(subparsers)`; `python -m cli.launch`
runs it alone (e.g. on a host where only the deploy tools are wanted). The environment
(TANDEM_HOME, for the default state folder) is read here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from cli.common_args import dispatch


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="start a multi-host topology (TOML) and serve until Ctrl-C",
        description="Start the coordinator and workers of TOPOLOGY on their hosts (SSH for "
                    "remote hosts, local processes for this one), wait until every worker is "
                    "registered, print the endpoints and serve until Ctrl-C, SIGTERM or "
                    "`tandem launch --down TOPOLOGY`. Examples: deploy/*.toml.")
    p.add_argument("topology", help="topology file (TOML)")
    p.add_argument("--down", action="store_true",
                   help="stop the processes a running `tandem launch TOPOLOGY` started")
    p.add_argument("--pull", action="store_true",
                   help="first run `tandem pull MODEL` on every host, into each host's own cache")
    p.add_argument("--check", action="store_true",
                   help="only check the file and every host (reachable, model present and "
                        "identical, ports free), then exit")
    p.add_argument("--insecure-internal-plane", action="store_true",
                   help="start without a cluster secret (unless $TANDEM_CLUSTER_SECRET or "
                        "[security] gives one) even off loopback: anyone who reaches the "
                        "Registry can then register as a worker (also [security] "
                        "insecure_internal_plane = true)")
    p.add_argument("--state-dir",
                   help="logs and launch record (default: the file's log_dir, else "
                        "$TANDEM_HOME/launch/<name>-<hash>)")
    p.set_defaults(func=cmd_launch)


def cmd_launch(args: argparse.Namespace) -> int:
    from deploy.launch import default_state_dir, down, launch, preflight, pull_everywhere
    from deploy.topology import load_topology
    from common.model_store import default_home

    topology = load_topology(args.topology)
    if args.insecure_internal_plane:
        topology = dataclasses.replace(topology, insecure_internal_plane=True)
    if args.state_dir:
        state_dir = Path(args.state_dir)
    else:
        state_dir = topology.log_dir or default_state_dir(default_home(), Path(args.topology))
    if args.down:
        return down(topology, state_dir)
    if args.pull:
        pull_everywhere(topology)
    if args.check:
        preflight(topology)
        print(f"{args.topology}: every host is reachable, has the model and free ports")
        return 0
    return launch(topology, state_dir, os.environ, lock_dir=default_home() / "run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.launch")
    register(parser.add_subparsers(dest="command", required=True))
    return dispatch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
