"""Test-wide settings.

TRITON_INTERPRET must be set before any Triton kernel is decorated, so it is set here, before
tests import kernels. One torch thread per process: this suite runs on 2-core machines, often
beside worker processes that it starts itself.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# TANDEM_TEST_DEVICE=cuda (benchmarks/device_check.py): the kernel tests' Triton launchers on a GPU.
from tests.helpers.device_launchers import triton_on_test_device  # noqa: E402,F401 - an autouse fixture

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Files whose tests start processes (clusters, workers, network namespaces, child pytest runs):
# marked `integration`, as is every test that loads the default model (through `default_gguf`
# or the `model` marker), so that `pytest -m "not integration"` runs the fast part alone.
INTEGRATION_FILES = {
    "benchmarks/test_bench_engine.py", "benchmarks/test_bench_engine_peer.py",
    "benchmarks/test_device_check.py",
    "cli/test_bench.py", "cli/test_cli.py",
    "common/test_cluster_auth.py", "common/test_core_lease.py",
    "coordinator/test_api_embeddings.py", "coordinator/test_api_ollama.py",
    "coordinator/test_default_model_tools.py",
    "coordinator/test_api_openai_grpc.py", "coordinator/test_api_structured.py",
    "coordinator/test_client_litellm.py", "coordinator/test_client_llamaindex.py",
    "coordinator/test_client_lm_eval.py",
    "coordinator/test_keep_alive_cluster.py", "coordinator/test_tenant_cache.py",
    "coordinator/test_response_cache_cluster.py", "coordinator/test_response_cache_semantic.py",
    "coordinator/test_isolation_attacks.py", "coordinator/test_multi_model_cluster.py",
    "coordinator/test_ollama_layers_cluster.py",
    "coordinator/test_ui_page.py",
    "deploy/test_cluster_auth_netns.py", "deploy/test_cluster_lifetime.py",
    "deploy/test_coordinator_deploy.py", "deploy/test_two_coordinators.py",
    "deploy/test_core_lease_serve.py",
    "deploy/test_deploy_netns.py", "deploy/test_deploy_pairing.py", "deploy/test_deploy_ray.py",
    "deploy/test_deploy_ssh.py", "deploy/test_deploy_topology.py", "deploy/test_serve_secret.py",
    "deploy/test_adversarial.py",
    "engine/test_logprobs_engine.py",
    "kernels/test_dispatch_levels.py", "kernels/test_triton_model_path.py",
    "kvtransfer/test_kvtransfer_dist.py", "kvtransfer/test_kvtransfer_shm.py",
    "nodes/test_disaggregation.py", "nodes/test_speculative_cluster.py",
    "reliability/test_chaos.py", "reliability/test_fuzz_http.py",
    "worker/test_core_share.py",
}
TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        relative = Path(str(item.path)).resolve().relative_to(TESTS_DIR).as_posix()
        if ("default_gguf" in item.fixturenames or item.get_closest_marker("model")
                or relative in INTEGRATION_FILES):
            item.add_marker(pytest.mark.integration)


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model, fetched by `tandem pull smollm2` before the suite runs (.ci/run does)."""
    path = tandem_home() / "models" / DEFAULT_GGUF_NAME
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `tandem pull smollm2` first")
    return path


# The llama.cpp oracle files in tests/data (README there says how they were made), with the
# number of records each must hold: a test that loops over an emptied or truncated file fails
# here instead of passing on nothing.
ORACLE_FILES = {
    "smollm2-greedy-llamacpp.jsonl": (13, {"messages", "prompt_ids", "output_ids", "output_text"}),
    "smollm2-tokenizer-llamacpp.jsonl": (157, {"text", "ids"}),
}


def load_oracle(name: str) -> list[dict]:
    import json

    expected_rows, keys = ORACLE_FILES[name]
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    assert lines and "_meta" in json.loads(lines[0]), f"{name}: the first line must be the _meta record"
    rows = [json.loads(line) for line in lines[1:]]
    assert len(rows) == expected_rows, f"{name}: {len(rows)} records, expected {expected_rows}"
    for row in rows:
        assert keys <= row.keys(), f"{name}: record without {keys - row.keys()}"
    return rows


@pytest.fixture(scope="session")
def greedy_oracle() -> list[dict]:
    """llama.cpp's chat prompts' ids and 48 greedy output tokens on the default model."""
    return load_oracle("smollm2-greedy-llamacpp.jsonl")


@pytest.fixture(scope="session")
def tokenizer_oracle() -> list[dict]:
    """llama.cpp's token ids for a 157-line fuzz corpus."""
    return load_oracle("smollm2-tokenizer-llamacpp.jsonl")
