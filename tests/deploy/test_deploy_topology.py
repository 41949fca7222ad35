"""Topology files for `tandem launch`: the examples parse and plan the right commands; bad
files and bad hosts (unknown role, duplicate port, unreachable host, mismatched or missing
model, port in use) fail with a clear error before any role process starts; `--down` stops
recorded processes when the launcher itself is gone."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.hosts import role_command
from deploy.launch import down, launch, plan_launch, preflight
from deploy.topology import TopologyError, load_topology, parse_topology
from tests.helpers.deploy_helpers import free_port_block
from reliability.model_factory import make_tiny_gguf

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOURCE = Path("topology.toml")
SECRET = "0123456789abcdef" * 4


def parse(text: str):
    from deploy.topology import tomllib  # tomli before Python 3.11

    return parse_topology(tomllib.loads(text), SOURCE)


BASE = """
model = "tiny"
[coordinator]
host = "127.0.0.1"
port = 11434
[[prefill]]
host = "127.0.0.1"
port = 50061
[[decode]]
host = "127.0.0.1"
port = 50071
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Two different tiny models, each dropped into its own host's store as `tiny`."""
    root = tmp_path_factory.mktemp("models")
    homes = {}
    for name, seed in (("a", 0), ("b", 1)):
        homes[name] = root / f"home-{name}"
        (homes[name] / "models").mkdir(parents=True)
        make_tiny_gguf(homes[name] / "models" / "tiny.gguf", seed=seed)
    homes["a2"] = root / "home-a2"  # another host with the same file as "a"
    (homes["a2"] / "models").mkdir(parents=True)
    shutil.copy(homes["a"] / "models" / "tiny.gguf", homes["a2"] / "models" / "tiny.gguf")
    homes["empty"] = root / "home-empty"
    homes["empty"].mkdir()
    return homes


def two_hosts(home_1: Path, home_2: Path, port_base: int = 0, extra: str = "") -> str:
    """Coordinator and prefill on 127.0.0.1, decode on 127.0.0.2: two local 'hosts'."""
    p = port_base or free_port_block()
    return f"""
model = "tiny"
{extra}
[hosts.one]
address = "127.0.0.1"
env = {{ TANDEM_HOME = "{home_1}" }}
[hosts.two]
address = "127.0.0.2"
env = {{ TANDEM_HOME = "{home_2}" }}
[coordinator]
host = "one"
port = {p}
registry_port = {p + 1}
[[prefill]]
host = "one"
port = {p + 2}
[[decode]]
host = "two"
port = {p + 3}
kv_port = {p + 4}
"""


# ---- the file alone -----------------------------------------------------------------------------

def test_examples_parse_and_plan_commands_for_their_hosts(tmp_path):
    examples = sorted(DEPLOY.glob("*.toml"))
    assert {p.name for p in examples} >= {"loopback.toml", "three-hosts.toml", "netns.toml"}
    for path in examples:
        load_topology(path)

    t = load_topology(DEPLOY / "three-hosts.toml")
    specs, ready = plan_launch(t, tmp_path, "run1", SECRET)
    assert [s.name for s in specs] == ["coordinator", "prefill-0", "decode-0", "decode-1"]
    assert ready.url == "http://10.0.0.1:11434"
    assert ready.worker_ids == ("prefill-0", "decode-0", "decode-1")
    decode_1 = specs[3]
    # Over ssh: the remote shell records its PID, then execs the worker with the host's env.
    assert decode_1.argv[:1] == ["ssh"] and "tandem@10.0.0.3" in decode_1.argv
    remote = decode_1.argv[-1]
    # The secret comes on ssh's stdin, read by the remote shell's builtin: on no command line.
    assert ("echo $$ > /tmp/tandem-launch-run1/decode-1.pid && IFS= read -r TANDEM_CLUSTER_SECRET"
            " && export TANDEM_CLUSTER_SECRET && exec env") in remote
    assert decode_1.stdin == f"{SECRET}\n".encode() and decode_1.env == ()
    assert all(SECRET not in " ".join(s.argv + list(s.signal_argv)) for s in specs)
    assert "TANDEM_HOME=/data/tandem /opt/tandem/.venv/bin/python -m decode_node" in remote
    for flag in ("--host 0.0.0.0", "--advertise-host 10.0.0.3", "--coordinator 10.0.0.1:50050",
                 "--kv-port 50081", "--worker-id decode-1", "--role decode"):
        assert flag in remote, flag
    assert decode_1.signal_argv[-1] == \
        'kill -{signal} "$(cat /tmp/tandem-launch-run1/decode-1.pid)"'
    coordinator = specs[0].argv[-1]
    assert "--registry-host 0.0.0.0 --registry-port 50050" in coordinator
    assert "--grpc-host 0.0.0.0 --grpc-port 50051" in coordinator
    # A coordinator over ssh answers the launcher's readiness poll from the topology's hosts.
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        assert f"--internal-api-from {address}/32" in coordinator

    t = load_topology(DEPLOY / "netns.toml")
    specs, _ = plan_launch(t, tmp_path, "run2", SECRET)
    assert all(dict(s.env) == {"TANDEM_CLUSTER_SECRET": SECRET} and not s.stdin for s in specs)
    # A prefix host: the prefix, then env, then the worker; signalled directly (no ssh).
    assert specs[1].argv[:5] == ["ip", "netns", "exec", "tdm-h2", "env"]
    assert specs[1].signal_argv == ()
    assert specs[0].argv[0] == "env"  # h1 is the launcher's own host
    assert "--internal-api-from" not in " ".join(specs[0].argv)  # same host: nothing to open


TWO_COORDINATORS = BASE.replace("[coordinator]", "[[coordinator]]") + """
[[coordinator]]
host = "127.0.0.2"
port = 11435
registry_port = 50052
grpc_port = 50053
"""


def test_several_coordinators_each_get_every_worker_and_are_polled_and_stopped_last(tmp_path):
    t = parse(TWO_COORDINATORS)
    assert [c.name for c in t.coordinators] == ["coordinator-0", "coordinator-1"]
    assert t.urls == ("http://127.0.0.1:11434", "http://127.0.0.2:11435")
    assert t.registry_address == "127.0.0.1:50050,127.0.0.2:50052"
    specs, ready = plan_launch(t, tmp_path, "run1", SECRET)
    assert [s.name for s in specs] == ["coordinator-0", "coordinator-1", "prefill-0", "decode-0"]
    assert ready.urls == t.urls  # ready once both report every worker
    second = specs[1].argv
    assert second[second.index("--port") + 1] == "11435"
    assert second[second.index("--registry-host") + 1] == "127.0.0.2"
    assert second[second.index("--grpc-port") + 1] == "50053"
    for worker in specs[2:]:
        assert worker.argv[worker.argv.index("--coordinator") + 1] == \
            "127.0.0.1:50050,127.0.0.2:50052"
    # One [coordinator] table keeps its single name (logs, launch records).
    assert [c.name for c in parse(BASE).coordinators] == ["coordinator"]
    load_topology(DEPLOY / "two-coordinators.toml")
    with pytest.raises(TopologyError, match="duplicate port 11434 on host '127.0.0.1': "
                                            "coordinator-1 port and coordinator-0 port"):
        parse(TWO_COORDINATORS.replace('"127.0.0.2"\nport = 11435', '"127.0.0.1"\nport = 11434'))
    with pytest.raises(TopologyError, match=r"\[\[coordinator\]\] #2: unknown key 'gpu'"):
        parse(TWO_COORDINATORS + "gpu = 1\n")
    with pytest.raises(TopologyError, match="names starting with 'coordinator'"):
        parse(BASE + '[[decode]]\nhost = "127.0.0.1"\nport = 50072\nname = "coordinator-1"\n')
    with pytest.raises(TopologyError, match=r"missing \[coordinator\]"):
        parse('model = "tiny"\ncoordinator = []\n')


def test_unknown_role_is_named():
    with pytest.raises(TopologyError, match=r"unknown role \[verifier\]; roles are "
                                            r"coordinator, prefill, decode, colocated"):
        parse(BASE + '[[verifier]]\nhost = "127.0.0.1"\nport = 50090\n')
    with pytest.raises(TopologyError, match=r"\[\[decode\]\] #2: unknown key 'gpu'"):
        parse(BASE + '[[decode]]\nhost = "127.0.0.1"\nport = 50072\ngpu = 1\n')


def test_duplicate_port_names_both_roles():
    with pytest.raises(TopologyError, match="duplicate port 50061 on host '127.0.0.1': "
                                            "decode-1 port and prefill-0 port"):
        parse(BASE + '[[decode]]\nhost = "127.0.0.1"\nport = 50061\n')
    with pytest.raises(TopologyError, match="duplicate port 11434 on host '127.0.0.1': "
                                            "decode-1 kv_port and coordinator port"):
        parse(BASE + '[[decode]]\nhost = "127.0.0.1"\nport = 50072\nkv_port = 11434\n')
    # The same port on two hosts is fine.
    parse(BASE + '[[decode]]\nhost = "127.0.0.2"\nport = 50061\n')


@pytest.mark.parametrize("text,message", [
    (BASE.replace('model = "tiny"', ""), "missing 'model'"),
    (BASE.replace("port = 50071", ""), r"\[\[decode\]\] #1: missing 'port'"),
    (BASE.replace("port = 50071", "port = 70000"), "port must be a port in 1..65535"),
    (BASE.replace('model = "tiny"', 'model = "tiny"\nkv_backend = "pigeon"'), "kv_backend must"),
    (BASE.replace("[[decode]]", "[[prefill]]"), r"no \[\[decode\]\] or \[\[colocated\]\]"),
    (BASE.replace('"127.0.0.1"', '"10.0.0.8"')
     .replace('[[decode]]\nhost = "10.0.0.8"', '[[decode]]\nhost = "10.0.0.9"')
     .replace('model = "tiny"', 'model = "tiny"\nkv_backend = "shm"'),
     "kv_backend 'shm' needs every worker on one host"),
    (BASE.replace('[[decode]]\nhost = "127.0.0.1"', '[[decode]]\nhost = "10.0.0.9"'),
     "loopback addresses, which roles on the other hosts cannot reach"),
    (BASE.replace("port = 50071", 'port = 50071\nargs = ["--block-size", "32"]'),
     r"different --block-size \(prefill-0=16, decode-0=32\)"),
    (BASE.replace("port = 50061", "port = 50061\nkv_port = 50062"), "kv_port belongs to decode"),
    (BASE.replace('host = "127.0.0.1"\nport = 50061', 'host = "gpu a!"\nport = 50061'),
     "host 'gpu a!' is neither declared under"),
    ("model = 1\n[coordinator]", "model must be a non-empty string"),
])
def test_bad_settings_are_named(text, message):
    with pytest.raises(TopologyError, match=message):
        parse(text)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read topology"):
        load_topology(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(TopologyError, match="not valid TOML"):
        load_topology(bad)


# ---- the hosts, before anything starts ----------------------------------------------------------

def test_unreachable_ssh_host_is_reported_before_anything_starts(tmp_path, models):
    # ssh to a loopback port nothing listens on: refused at once, no other network used.
    text = two_hosts(models["a"], models["a"]).replace(
        'address = "127.0.0.2"',
        'address = "127.0.0.2"\nssh = "nobody@127.0.0.1"\nssh_options = ["-p", "9"]')
    path = tmp_path / "t.toml"
    path.write_text(text)
    state_dir = tmp_path / "state"
    with pytest.raises(TopologyError) as info:
        launch(load_topology(path), state_dir)
    message = str(info.value)
    assert "cannot launch, nothing was started" in message
    assert "host 'two' (127.0.0.2, via ssh nobody@127.0.0.1) is unreachable" in message
    assert not state_dir.exists()  # no log, no state: no process was started


def test_mismatched_model_across_hosts_is_refused_before_anything_starts(tmp_path, models):
    path = tmp_path / "t.toml"
    path.write_text(two_hosts(models["a"], models["b"]))
    with pytest.raises(TopologyError) as info:
        launch(load_topology(path), tmp_path / "state")
    message = str(info.value)
    assert "mismatched model: 'tiny' is not the same model on every host" in message
    assert f"on one ({models['a'] / 'models' / 'tiny.gguf'})" in message
    assert f"on two ({models['b'] / 'models' / 'tiny.gguf'})" in message
    assert not (tmp_path / "state").exists()


def test_missing_model_and_busy_port_are_reported_per_host(tmp_path, models):
    base = free_port_block()
    path = tmp_path / "t.toml"
    path.write_text(two_hosts(models["a"], models["empty"], port_base=base))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 2))  # prefill-0's port
        busy.listen()
        with pytest.raises(TopologyError) as info:
            preflight(load_topology(path))
    message = str(info.value)
    assert ("host 'two' (127.0.0.2, via this machine): model 'tiny' is not available there: "
            "no model named 'tiny'") in message
    assert "(run `tandem pull tiny` on that host)" in message
    assert f"host 'one' (127.0.0.1, via this machine): port {base + 2} is in use" in message


def test_missing_or_bad_security_files_are_reported_per_host_before_anything_starts(tmp_path, models):
    from tests.helpers.tls_certs import issue, make_ca

    node = issue(tmp_path, make_ca(tmp_path / "ca"), "node")
    secret = tmp_path / "secret"
    security = (f'[security]\ncluster_secret_file = "{tmp_path / "nope"}"\n'
                f'tls_cert = "{node.cert}"\ntls_key = "{node.key}"\ntls_ca = "{node.ca}"\n')
    path = tmp_path / "t.toml"
    path.write_text(two_hosts(models["a"], models["a2"], extra=security))
    with pytest.raises(TopologyError) as info:
        launch(load_topology(path), tmp_path / "state")
    message = str(info.value)
    assert "cannot launch, nothing was started" in message
    for host in ("host 'one' (127.0.0.1, via this machine)", "host 'two' (127.0.0.2, via this machine)"):
        assert (f"{host}: [security]: cluster secret file {tmp_path / 'nope'} does not exist "
                "on that host") in message
    assert not (tmp_path / "state").exists()

    secret.write_text("short\n")  # the roles would refuse it at start-up: so does the probe
    path.write_text(two_hosts(models["a"], models["a2"], extra=security.replace(
        str(tmp_path / "nope"), str(secret))))
    with pytest.raises(TopologyError, match="the cluster secret is too short"):
        preflight(load_topology(path))

    secret.write_text("correct horse battery staple 42\n")
    path.write_text(two_hosts(models["a"], models["a2"], extra=security.replace(
        str(tmp_path / "nope"), str(secret)).replace(str(node.key), str(node.cert))))
    with pytest.raises(TopologyError) as info:
        preflight(load_topology(path))
    assert f"TLS key file {node.cert} holds no PEM private key on that host" in str(info.value)

    path.write_text(two_hosts(models["a"], models["a2"], extra=security.replace(
        str(tmp_path / "nope"), str(secret))))
    answers = preflight(load_topology(path))
    assert answers["one"]["auth"] is None and answers["two"]["auth"] is None
    assert "correct horse" not in json.dumps(answers)  # the probe never prints the secret


def test_same_model_on_every_host_passes_preflight(tmp_path, models):
    path = tmp_path / "t.toml"
    path.write_text(two_hosts(models["a"], models["a2"]))
    answers = preflight(load_topology(path))
    assert answers["one"]["model"]["fingerprint"] == answers["two"]["model"]["fingerprint"]
    assert answers["two"]["model"]["path"] == str(models["a2"] / "models" / "tiny.gguf")


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(BASE + '[[decode]]\nhost = "127.0.0.1"\nport = 50061\n')
    done = subprocess.run([sys.executable, "-m", "cli.main", "launch", str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TANDEM_HOME": str(tmp_path / "home")})
    assert done.returncode == 1
    assert done.stderr.startswith("Error: ") and "duplicate port 50061" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "home").exists()


# ---- stopping ---------------------------------------------------------------------------------

def test_down_stops_recorded_processes_when_the_launcher_is_gone(tmp_path):
    from common.processes import start_time

    t = parse(BASE)
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True) for _ in range(3)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    try:
        state = {"topology": "t", "launcher_pid": gone.pid, "launcher_start": "1",
                 "processes": [{"name": n, "pid": p.pid, "start": start_time(p.pid),
                                "signal_argv": []}
                               for n, p in zip(("coordinator", "prefill-0", "decode-0"), sleepers)]}
        (tmp_path / "launch.json").write_text(json.dumps(state))
        lines = []
        assert down(t, tmp_path, out=lines.append, grace_s=10) == 0
        assert [p.wait(10) for p in sleepers] == [-15, -15, -15]
        assert lines == ["stopped"]
        assert not (tmp_path / "launch.json").exists()
        assert down(t, tmp_path, out=lines.append) == 0
        assert lines[-1].startswith("nothing to stop")
    finally:
        for p in sleepers:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_role_command_over_ssh_quotes_arguments():
    from deploy.topology import Host

    host = Host(name="h", address="10.0.0.5", bind="0.0.0.0", ssh="me@h",
                env=(("TANDEM_HOME", "/data/my models"),))
    argv, signal_argv = role_command(host, ["python3", "-m", "x", "--flag", "a b; rm -rf /"],
                                     "/tmp/run", "decode-0")
    assert argv[-2] == "me@h"
    assert argv[-1] == ("mkdir -p /tmp/run && echo $$ > /tmp/run/decode-0.pid && exec env "
                        "'TANDEM_HOME=/data/my models' python3 -m x --flag 'a b; rm -rf /'")
    assert signal_argv[-2:] == ("me@h", 'kill -{signal} "$(cat /tmp/run/decode-0.pid)"')


def test_pull_on_every_host_names_the_hosts_where_it_failed(tmp_path, models):
    from deploy.launch import pull_everywhere

    # "tiny" is no model the store can fetch, so the pull fails on each host, offline.
    path = tmp_path / "t.toml"
    path.write_text(two_hosts(models["a"], models["b"]))
    with pytest.raises(TopologyError) as info:
        pull_everywhere(load_topology(path), out=lambda line: None)
    message = str(info.value)
    for host in ("host 'one' (127.0.0.1", "host 'two' (127.0.0.2"):
        assert f"{host}, via this machine): `tandem pull tiny` failed: Error: unknown model " \
               "'tiny'" in message


# ---- several models -----------------------------------------------------------------------------

MULTI = """
model = ["tiny", "qwen3:0.6b"]
[coordinator]
host = "127.0.0.1"
port = 11434
[[prefill]]
host = "127.0.0.1"
port = 50061
[[decode]]
host = "127.0.0.1"
port = 50071
[[decode]]
host = "127.0.0.1"
port = 50072
model = "qwen3:0.6b"
[[decode]]
host = "127.0.0.1"
port = 50073
model = "qwen3:0.6b"
"""


def test_several_models_each_with_workers_of_its_own(tmp_path):
    from coordinator.__main__ import build_parser

    t = parse(MULTI)
    assert t.models == ("tiny", "qwen3:0.6b") and t.model == "tiny"
    assert [(w.name, w.model) for w in t.workers] == [
        ("prefill-0", "tiny"), ("decode-0", "tiny"), ("decode-1", "qwen3:0.6b"),
        ("decode-2", "qwen3:0.6b")]
    specs, ready = plan_launch(t, tmp_path, "run", SECRET)
    argv = specs[0].argv
    coordinator = build_parser().parse_args(argv[argv.index("coordinator") + 1:])
    assert coordinator.model == ["tiny", "qwen3:0.6b"]
    for spec, model in zip(specs[1:], ("tiny", "tiny", "qwen3:0.6b", "qwen3:0.6b")):
        assert spec.argv[spec.argv.index("--model") + 1] == model
    assert ready.expected == {"prefill": 1, "decode": 3}
    assert ready.worker_ids == ("prefill-0", "decode-0", "decode-1", "decode-2")
    host = t.workers[0].host
    assert t.models_on(host) == ("tiny", "qwen3:0.6b")  # the coordinator's host: every model


@pytest.mark.parametrize("text, message", [
    (MULTI.replace('model = "qwen3:0.6b"\n[[decode]]', 'model = "gamma"\n[[decode]]', 1),
     r"\[\[decode\]\] #2: model 'gamma' is not one of the topology's models \(tiny, qwen3:0.6b\)"),
    (MULTI.replace('model = ["tiny", "qwen3:0.6b"]', 'model = ["tiny", "qwen3:0.6b", "c"]'),
     "model 'c' has no \\[\\[decode\\]\\] or \\[\\[colocated\\]\\] worker"),
    (MULTI.replace('model = ["tiny", "qwen3:0.6b"]', 'model = ["tiny", "tiny"]'),
     "a model is listed twice in model: tiny, tiny"),
    (MULTI.replace('model = ["tiny", "qwen3:0.6b"]', "model = []"),
     "model must be a name or a non-empty list of names"),
])
def test_several_models_mistakes_are_named(text, message):
    with pytest.raises(TopologyError, match=message):
        parse(text)


def test_preflight_asks_each_host_for_the_models_its_roles_need(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for home, names in ((one, ("tiny", "other")), (two, ("other",))):
        (home / "models").mkdir(parents=True)
        for name in names:
            make_tiny_gguf(home / "models" / f"{name}.gguf", seed=0 if name == "tiny" else 1)

    def topology(model_on_one: str, model_on_two: str):
        text = two_hosts(one, two).replace('model = "tiny"', 'model = ["tiny", "other"]', 1)
        text = text.replace("[[prefill]]\nhost = \"one\"",
                            f'[[decode]]\nhost = "one"\nmodel = "{model_on_one}"', 1)
        return parse(text.replace("kv_port", f'model = "{model_on_two}"\nkv_port', 1))

    t = topology("tiny", "other")
    assert [(w.model, w.host.name) for w in t.workers] == [("tiny", "one"), ("other", "two")]
    assert t.models_on(t.workers[1].host) == ("other",)
    preflight(t)  # host two has no tiny, and needs none
    with pytest.raises(TopologyError) as info:
        preflight(topology("other", "tiny"))
    message = str(info.value)
    assert "host 'two' (127.0.0.2, via this machine): model 'tiny' is not available there" in message
    assert "'other' is not available" not in message and "mismatched" not in message


def test_the_probe_finds_a_model_in_ollamas_store_as_the_roles_do(tmp_path, monkeypatch):
    from deploy.probe import check_model
    from tests.helpers.foreign_stores import make_ollama_store

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf").path
    store = make_ollama_store(tmp_path / "ollama", gguf, name="library/qwen3", tag="0.6b")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    found = check_model("qwen3:0.6b")
    assert Path(found["path"]).parent == store / "blobs" and found["fingerprint"]
    assert "error" in check_model("qwen3:8b")


def test_local_tandem_processes_join_the_launchers_session_and_wrappers_do_not(tmp_path):
    """deploy/local.py session_of: this Python's processes get a process group in the
    launcher's session (one scheduling group under the kernel's autogroup); a wrapper that may
    prompt on a terminal (ssh, sudo) gets a session of its own, so no terminal."""
    import sys

    from deploy.local import OWN_PROCESS_GROUP, session_of
    from deploy.process_plan import ProcessSpec

    def spec(*argv: str) -> ProcessSpec:
        return ProcessSpec("decode-0", list(argv), tmp_path / "log")

    assert session_of(spec(sys.executable, "-m", "decode_node")) == OWN_PROCESS_GROUP
    if sys.version_info >= (3, 11):
        assert OWN_PROCESS_GROUP == {"process_group": 0}
    for wrapper in (("ssh", "-o", "BatchMode=yes", "h1", "python3"),
                    ("sudo", "ip", "netns", "exec", "n1", sys.executable)):
        assert session_of(spec(*wrapper)) == {"start_new_session": True}
