"""The repository keeps its promises about itself: CI runs the README's test command, the
license file matches pyproject.toml, the tests mirror the packages, and the integration marker
names files that exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import INTEGRATION_FILES, TESTS_DIR

ROOT = TESTS_DIR.parent


def _readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Two commands", 1)[1]
    return re.findall(r"```bash\n(.+?)\n```", section.split("\n## ", 1)[0])


def test_ci_runs_the_readme_test_command_verbatim():
    serve, test = _readme_commands()[:2]
    assert serve.endswith("tandem serve") and "pytest" in test
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert test in ci


def test_the_license_file_is_the_one_pyproject_names():
    pyproject = ROOT.joinpath("pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    text = ROOT.joinpath("LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_tests_mirror_the_packages():
    folders = {p.name for p in TESTS_DIR.iterdir() if p.is_dir() and p.name not in
               ("data", "helpers", "__pycache__")}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    # nodes/: the two worker packages and their shared runtime, tested together
    assert folders - {"nodes"} <= packages, folders - packages
    for folder in folders:
        assert (TESTS_DIR / folder / "__init__.py").is_file(), folder
        assert list((TESTS_DIR / folder).glob("test_*.py")), folder
    assert not list((TESTS_DIR / "helpers").glob("test_*.py"))


def test_integration_files_exist():
    assert sorted(f for f in INTEGRATION_FILES if not (TESTS_DIR / f).is_file()) == []
