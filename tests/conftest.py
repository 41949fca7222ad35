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

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model, fetched by `tandem pull smollm2` before the suite runs (.ci/run does)."""
    path = tandem_home() / "models" / DEFAULT_GGUF_NAME
    if not path.exists():
        pytest.fail(f"default model missing at {path}: run `tandem pull smollm2` first")
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """llama.cpp oracle data beside the repo (../shared/data), or TANDEM_SHARED_DATA."""
    path = Path(os.environ.get("TANDEM_SHARED_DATA", SHARED_DATA))
    if not path.exists():
        pytest.fail(f"oracle data missing at {path}")
    return path
