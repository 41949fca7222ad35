"""engine/ holds only what both workers run, and kernels/ sits below it: neither imports the
packages built on top of it. Read statically (ast), so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[str, set[str]]:
    """Per file under ROOT/package, the top-level names it imports (relative imports stay inside
    the package, so they are left out)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def _offenders(package: str, forbidden: set[str]) -> dict[str, list[str]]:
    files = _imports(package)
    assert len(files) > 5, files  # the walk found the package
    return {f: sorted(names & forbidden) for f, names in files.items() if names & forbidden}


def test_engine_imports_nothing_above_it():
    assert _offenders("engine", {"coordinator", "deploy", "prefill_node", "decode_node"}) == {}


def test_kernels_import_nothing_above_them():
    forbidden = {"engine", "coordinator", "deploy", "prefill_node", "decode_node", "kvtransfer"}
    assert _offenders("kernels", forbidden) == {}
