"""A recommended cluster as a topology TOML that `tandem launch` reads (deploy/topology.py).

Written as text (the standard library reads TOML but does not write it). Every role goes on
one placeholder host with its own ports, so the file parses and launches as it is on one
machine; for a real cluster replace each `host` with the machine that role runs on (a name
under [hosts.NAME] or an address). Settings the plan chose: `chunk_size` (each prefill
pass's token budget) and each decode worker's `--max-num-seqs` (its batch cap).
"""

from __future__ import annotations

import json


def topology_toml(*, model: str, prefill: int, decode: int, token_budget: int, max_batch: int,
                  host: str = "127.0.0.1", first_port: int = 50100, kv_backend: str = "zmq",
                  comment: str = "") -> str:
    """The TOML text. When one host has too few ports for every worker, each worker gets a
    placeholder host of its own (prefill-0, decode-0, ... with the coordinator on
    `coordinator`), every one listening on the same ports, to be replaced by real machines."""
    if prefill < 1 or decode < 1:
        raise ValueError(f"a topology needs >= 1 prefill and >= 1 decode worker, got {prefill}, {decode}")
    one_host = first_port + prefill + 2 * decode <= 65536
    s = json.dumps  # a JSON string is a valid TOML basic string
    where = (f"Every role is on {host}: give each its own machine before launching off one host."
             if one_host else "Each role is on a placeholder host named after it: replace those with "
                              "your machines' names or addresses.")
    lines = [f"# {line}" for line in comment.splitlines()] + [
        f"# Written by `tandem plan`: {prefill} prefill + {decode} decode workers, token budget "
        f"{token_budget}, decode batch cap {max_batch}.", f"# {where}",
        f"model = {s(model)}", f"kv_backend = {s(kv_backend)}", f"chunk_size = {token_budget}", "",
        "[coordinator]", f"host = {s(host if one_host else 'coordinator')}", "port = 11434",
        "registry_port = 50050", "grpc_port = 50051", ""]
    port = first_port
    for i in range(prefill):
        name = f"prefill-{i}"
        lines += ["[[prefill]]", f"name = {s(name)}", f"host = {s(host if one_host else name)}",
                  f"port = {port}", ""]
        port += one_host
    for i in range(decode):
        name = f"decode-{i}"
        lines += ["[[decode]]", f"name = {s(name)}", f"host = {s(host if one_host else name)}",
                  f"port = {port}", f"kv_port = {port + 1}",
                  f"args = [\"--max-num-seqs\", \"{max_batch}\"]", ""]
        port += 2 * one_host
    return "\n".join(lines)
