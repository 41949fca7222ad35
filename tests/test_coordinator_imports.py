"""The coordinator (and the local launcher) never import torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import coordinator

ROOT = Path(__file__).resolve().parents[1]


def test_coordinator_modules_do_not_import_torch():
    modules = ["coordinator"] + [f"coordinator.{m.name}"
                                 for m in pkgutil.iter_modules(coordinator.__path__)]
    modules += ["deploy", "deploy.local"]
    assert "coordinator.request_flow" in modules and "coordinator.__main__" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "print(bad)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
