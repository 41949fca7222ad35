"""`tandem show MODEL`: a model's details, from the running server, else from the cache."""

from __future__ import annotations

import argparse

from cli.common_args import add_server_args, server, store


def register(subparsers) -> None:
    p = subparsers.add_parser("show", help="a model's details")
    p.add_argument("model", help="model name, GGUF file or Hugging Face directory")
    add_server_args(p)
    p.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    running = server(args)
    if running.running():
        shown = running.show(args.model)
        details, info = shown["details"], shown.get("model_info") or {}
        arch = info.get("general.architecture", details.get("family", ""))
        rows = [("architecture", arch), ("parameters", details.get("parameter_size", "")),
                ("context length", info.get(f"{arch}.context_length", "")),
                ("embedding length", info.get(f"{arch}.embedding_length", "")),
                ("quantization", details.get("quantization_level", "")),
                ("format", details.get("format", ""))]
        capabilities = shown.get("capabilities") or []
    else:
        from common.model_files import load_config

        path = store().resolve(args.model)
        config = load_config(path)
        rows = [("architecture", config.architecture), ("path", str(path)),
                ("context length", config.max_position),
                ("embedding length", config.hidden_size), ("layers", config.num_layers)]
        capabilities = ["completion"]
    print("  Model")
    for key, value in rows:
        print(f"    {key:<20}{value}")
    print("\n  Capabilities")
    for capability in capabilities:
        print(f"    {capability}")
    return 0
