"""The import graph points one way, bottom to top, and has no cycles.

    common, kernels          torch-free shared layer; kernels (know nothing of requests)
    engine                   the inference core
    kvtransfer, worker       the KV data plane; the worker-process runtime
    prefill_node, decode_node, coordinator
    planner                  capacity planning (pure Python: imports nothing of tandem's)
    cli, deploy              the `tandem` command; launchers
    benchmarks, reliability  tools run from a checkout (never imported by the product)
    tests

Read statically (ast), so an import inside a function or under TYPE_CHECKING counts too: a
lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRODUCT = ["common", "kernels", "engine", "kvtransfer", "worker", "prefill_node", "decode_node",
           "coordinator", "planner", "cli", "deploy"]
TOOLS = ["benchmarks", "reliability"]
# package -> the tandem packages it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "kernels": set(),
    "engine": {"common", "kernels"},
    # shapes and dtypes only: no engine, no models; kernels for the fused copy+crc32c
    "kvtransfer": {"common", "kernels"},
    "worker": {"common", "kernels", "engine", "kvtransfer"},
    "prefill_node": {"common", "kernels", "engine", "kvtransfer", "worker"},
    "decode_node": {"common", "kernels", "engine", "kvtransfer", "worker"},
    "coordinator": {"common"},  # never torch: only the shared layer below it
    "planner": set(),  # runs anywhere, far from the cluster it sizes
    "deploy": {"common", "engine", "worker"},
    "cli": {"common", "kernels", "engine", "kvtransfer", "worker", "coordinator", "deploy",
            "prefill_node", "decode_node", "planner"},
    "benchmarks": set(PRODUCT),
    "reliability": set(PRODUCT),
}
PACKAGES = set(ALLOWED) | {"tests"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tandem modules `name` imports (`from pkg import submodule` counts the submodule)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                continue
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        pkg = module.split(".")[0]
        if pkg == "tests":
            continue
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{module} -> {target}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_package_is_read():
    graph = _graph()
    for pkg in ALLOWED:
        assert any(m.split(".")[0] == pkg for m in graph), pkg
    assert "coordinator.service" in graph and "common.errors" in graph["coordinator.service"]


def test_imports_point_one_way():
    assert layer_violations(_graph()) == []


def test_no_import_cycles():
    assert cycles(_graph()) == []


def test_the_checks_catch_a_reversed_import_and_a_cycle():
    graph = _graph()
    graph["common.errors"] = graph["common.errors"] | {"engine.llm_engine"}
    assert layer_violations(graph) == ["common.errors -> engine.llm_engine"]
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_each_package_opens_with_a_docstring():
    missing = [pkg for pkg in ALLOWED if not ast.get_docstring(
        ast.parse((ROOT / pkg / "__init__.py").read_text()))]
    assert missing == []


@pytest.mark.parametrize("package", ["coordinator", "common", "planner", "deploy.local", "cli.main"])
def test_torch_free_packages_do_not_load_torch(package):
    """The coordinator, the shared layer, the supervisor and the CLI's start-up never import
    torch (a coordinator host needs no torch; `tandem --help` stays fast)."""
    code = ("import importlib, pkgutil, sys\n"
            f"name = {package!r}\n"
            "mod = importlib.import_module(name)\n"
            "for info in pkgutil.walk_packages(getattr(mod, '__path__', []), name + '.'):\n"
            "    if not info.name.endswith('__main__'):\n"
            "        importlib.import_module(info.name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
