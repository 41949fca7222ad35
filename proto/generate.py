"""Regenerate every checked-in protobuf/gRPC stub from proto/*.proto.

Usage: python proto/generate.py   (needs grpcio-tools, a test dependency)

STUBS maps each .proto to the Python package that holds its generated modules. protoc writes
absolute imports (`import kvtransfer_pb2 as ...`), which only work with the output folder on
sys.path; they are rewritten to package-relative imports (`from . import kvtransfer_pb2 as ...`)
so the stubs import as part of their package. A .proto without an entry is an error, so a new
schema cannot be forgotten silently.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent

# .proto file (relative to proto/) -> output package folder (relative to the repo root).
STUBS: dict[str, str] = {
    "kvtransfer.proto": "kvtransfer/pb",
    "worker.proto": "common/rpc",
    "tandem.proto": "common/rpc",
}

_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2(?:_grpc)?) as (\w+)$", re.MULTILINE)


def _relativize(path: Path, local_modules: set[str]) -> None:
    text = path.read_text()

    def fix(m: re.Match[str]) -> str:
        if m.group(1) in local_modules:
            return f"from . import {m.group(1)} as {m.group(2)}"
        return m.group(0)

    path.write_text(_ABSOLUTE_IMPORT.sub(fix, text))


def generate() -> None:
    from grpc_tools import protoc  # noqa: PLC0415 (build-time dependency only)

    protos = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    missing = [p for p in protos if p not in STUBS]
    if missing:
        raise SystemExit(f"no output package for {missing}: add them to STUBS in {__file__}")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto, package in STUBS.items():
        out = ROOT / package
        out.mkdir(parents=True, exist_ok=True)
        init = out / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated protobuf/gRPC stubs (proto/generate.py); do not edit."""\n')
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        local = {p.stem for p in out.glob("*_pb2*.py")}
        for generated in out.glob("*_pb2*.py*"):
            _relativize(generated, local)
        print(f"{proto} -> {package}/")


if __name__ == "__main__":
    sys.exit(generate())
