"""`tandem run/list/ps/show` against a running tandem server, as a user types them; `--version`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx

from tests.api_cluster import GREEDY, MODEL, api  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]


def tandem(*args: str, stdin: str | None = None, host: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "deploy.cli", *args]
    if host is not None:
        argv += ["--host", host]
    return subprocess.run(argv, cwd=ROOT, input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_run_with_a_prompt_talks_to_the_server(api):
    want = httpx.post(api.url + "/api/chat", timeout=60, json={
        "model": MODEL, "stream": False, "options": GREEDY,
        "messages": [{"role": "user", "content": "Name three rivers."}]}).json()
    r = tandem("run", MODEL, "Name three rivers.", "--temperature", "0", "--num-predict",
               str(GREEDY["num_predict"]), "--verbose", host=api.url)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want["message"]["content"] + "\n"
    assert f"eval: {want['eval_count']} tokens" in r.stderr


def test_run_interactive_keeps_the_conversation(api):
    r = tandem("run", MODEL, "--temperature", "0", "--num-predict", "4", "--verbose",
               stdin="Hello\nAnd again\n/bye\n", host=api.url)
    assert r.returncode == 0, r.stderr
    counts = [int(line.split("prompt eval: ")[1].split()[0])
              for line in r.stderr.splitlines() if line.startswith("prompt eval:")]
    assert len(counts) == 2 and counts[1] > counts[0]  # the second turn carries the first


def test_list_ps_show(api):
    r = tandem("list", host=api.url)
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:2] == ["NAME", "ID"]
    assert r.stdout.splitlines()[1].split()[0] == MODEL
    r = tandem("ps", host=api.url)
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[0] == MODEL
    r = tandem("show", MODEL, host=api.url)
    assert r.returncode == 0 and "architecture" in r.stdout and "llama" in r.stdout
    assert "completion" in r.stdout


def test_errors_are_one_line(api):
    r = tandem("show", "nope", host=api.url)
    assert r.returncode == 1 and r.stderr == "Error: model 'nope' not found\n"
    r = tandem("run", "nope", "hi", host=api.url)
    assert r.returncode == 1 and r.stderr == "Error: model 'nope' not found\n"
    r = tandem("ps", host="127.0.0.1:1")
    assert r.returncode == 1 and "no tandem server is running" in r.stderr
    assert "Traceback" not in r.stderr


def test_version_is_the_installed_package_version():
    r = tandem("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"tandem {version('tandem')}\n"
