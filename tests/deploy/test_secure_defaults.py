"""Secure defaults of the launchers, without starting processes: `tandem launch` and the Ray
launcher refuse an internal plane off loopback without a cluster secret unless the operator
says insecure_internal_plane (a topology key or `--insecure-internal-plane`), and hand a
secret they make (or the operator's) to every process through its environment, never argv."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deploy.cluster_secret import INSECURE_WARNING, cluster_secret, write_secret_file
from deploy.launch import launch, plan_launch
from deploy.plane_security import launch_secret, launch_tls
from deploy.topology import TopologyError, load_topology, parse_topology, tomllib

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRET = "0123456789abcdef" * 4
LOOPBACK = """
model = "tiny"
[coordinator]
host = "127.0.0.1"
[[decode]]
host = "127.0.0.1"
port = 50071
"""


def test_an_open_plane_off_loopback_is_refused_unless_the_operator_asks_for_it(tmp_path):
    t = load_topology(DEPLOY / "three-hosts.toml")  # 0.0.0.0 on three hosts, no [security]
    assert t.off_loopback and t.secret_file is None
    with pytest.raises(TopologyError, match="refusing to start an internal plane that listens "
                                            "off loopback without a cluster secret"):
        plan_launch(t, tmp_path, "run")

    insecure = dataclasses.replace(t, insecure_internal_plane=True)  # --insecure-internal-plane
    specs, _ = plan_launch(insecure, tmp_path, "run")
    assert all(s.env == () and s.stdin == b"" for s in specs)
    text = (DEPLOY / "three-hosts.toml").read_text() + "\n[security]\ninsecure_internal_plane = true\n"
    assert parse_topology(tomllib.loads(text), DEPLOY / "x.toml").insecure_internal_plane
    with pytest.raises(TopologyError, match="insecure_internal_plane must be true or false"):
        parse_topology(tomllib.loads(text.replace("= true", '= "yes"')), DEPLOY / "x.toml")

    # On loopback nothing is reachable from elsewhere: planned without a secret.
    loopback = parse_topology(tomllib.loads(LOOPBACK), tmp_path / "t.toml")
    assert not loopback.off_loopback
    plan_launch(loopback, tmp_path, "run")


def test_the_launch_secret_is_the_operators_or_a_new_one_and_a_file_wins(tmp_path):
    t = load_topology(DEPLOY / "three-hosts.toml")
    made, fresh = launch_secret(t, {})
    again, _ = launch_secret(t, {})
    assert fresh and len(made) == 64 and made != again
    assert launch_secret(t, {"TANDEM_CLUSTER_SECRET": SECRET}) == (SECRET, False)
    assert launch_secret(dataclasses.replace(t, insecure_internal_plane=True), {}) == (None, False)
    with_file = dataclasses.replace(t, auth_args=("--cluster-secret-file", "/etc/tandem/secret"))
    assert launch_secret(with_file, {"TANDEM_CLUSTER_SECRET": SECRET}) == (None, False)
    plan_launch(with_file, tmp_path, "run")  # each host reads its own file: not refused
    path = write_secret_file(tmp_path / "state" / "cluster-secret", made)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == made + "\n"
    assert cluster_secret({"TANDEM_CLUSTER_SECRET": f" {SECRET}\n"}) == (SECRET, False)


def test_an_insecure_launch_says_so_before_anything_starts(tmp_path, monkeypatch):
    # This host, listening on every interface; no model "tiny" in an empty store.
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    text = LOOPBACK.replace('host = "127.0.0.1"', 'host = "here"') + (
        '[hosts.here]\naddress = "127.0.0.1"\nbind = "0.0.0.0"\n')
    t = parse_topology(tomllib.loads(text), tmp_path / "t.toml")
    assert t.off_loopback
    with pytest.raises(TopologyError, match="refusing to start"):
        plan_launch(t, tmp_path, "run")
    lines = []
    with pytest.raises(TopologyError, match="not available there"):  # the preflight
        launch(dataclasses.replace(t, insecure_internal_plane=True), tmp_path / "state", {},
               out=lines.append, lock_dir=tmp_path / "run")
    assert lines == [INSECURE_WARNING]
    assert not (tmp_path / "state").exists()


def test_ray_topologies_need_a_secret_or_the_insecure_flag():
    ray_launcher = pytest.importorskip("deploy.ray_launcher")
    with pytest.raises(ValueError, match="without a cluster secret"):
        ray_launcher.RayTopology(model="tiny")
    secure = ray_launcher.RayTopology(model="tiny", cluster_secret=SECRET)
    assert secure.process_env()["TANDEM_CLUSTER_SECRET"] == SECRET and SECRET not in repr(secure)
    open_plane = ray_launcher.RayTopology(model="tiny", insecure_internal_plane=True)
    assert "TANDEM_CLUSTER_SECRET" not in open_plane.process_env()


def test_off_loopback_the_launch_makes_a_ca_and_a_certificate_per_host(tmp_path):
    import base64
    import subprocess

    t = load_topology(DEPLOY / "three-hosts.toml")  # gpu-a (this one's coordinator) .. gpu-c
    tls = launch_tls(t, tmp_path / "state")
    folder = tmp_path / "state" / "tls"
    assert set(tls) == {h.name for h in t.hosts} and folder.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in folder.iterdir())
    for host in t.hosts:
        issued = tls[host.name]
        done = subprocess.run(["openssl", "verify", "-CAfile", str(issued.ca), str(issued.cert)],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                               str(issued.cert)], capture_output=True, text=True).stdout
        assert f"IP Address:{host.address}" in text

    specs, _ = plan_launch(t, tmp_path, "run", SECRET, tls)
    by_name = {s.name: s for s in specs}
    # gpu-c is reached over ssh: its files come on stdin after the secret, written 0600 there.
    decode = by_name["decode-1"]
    remote = decode.argv[-1]
    folder_there = "/tmp/tandem-launch-run/tls-decode-1"
    assert f"--tls-cert {folder_there}/cert.pem --tls-key {folder_there}/key.pem" in remote
    assert f"umask 077 && mkdir -p {folder_there}" in remote
    lines = decode.stdin.decode().splitlines()
    assert lines[0] == SECRET and len(lines) == 4
    issued = tls[next(r.host.name for r in t.workers if r.name == "decode-1")]
    assert [base64.b64decode(x) for x in lines[1:]] == [
        issued.cert.read_bytes(), issued.key.read_bytes(), issued.ca.read_bytes()]
    assert all(b"PRIVATE KEY" not in " ".join(s.argv).encode() for s in specs)

    assert launch_tls(parse_topology(tomllib.loads(LOOPBACK), tmp_path / "t.toml"), tmp_path) is None
    assert launch_tls(dataclasses.replace(t, insecure_internal_plane=True), tmp_path) is None
    given = dataclasses.replace(t, auth_args=("--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"))
    assert launch_tls(given, tmp_path) is None
