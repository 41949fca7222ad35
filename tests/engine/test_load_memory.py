"""Building a model holds what the model keeps plus about one matrix's temporaries, under the
serving process's malloc thresholds (common/malloc_policy.py). Before, a worker packed under
keep_freed_memory's 1 GiB mmap threshold, every matrix's fp32 temporaries stayed on the heap
until the whole model was built, and an 8B Q4_K_M prefill worker ran out of memory.

Measured in a fresh process (malloc state is per process) on a small random Q8_0 LLaMA:
peak anonymous memory from /proc/self/status (VmHWM reset through clear_refs, minus the file
pages mapped before the build, an upper bound since file pages only grow during it), against
the bytes the built model's tensors hold."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reliability.model_factory import make_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]

_MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    from common.malloc_policy import keep_freed_memory, loading_weights
    from engine.loaders import load_model
    from engine.models import model_class

    def status():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def held_bytes(obj, seen, visited=None):
        # visited: every object walked, so that a cycle (an enum member's class names the
        # member again: ModelConfig.pooling) is walked once.
        visited = set() if visited is None else visited
        if id(obj) in visited:
            return 0
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() in seen:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()
        if isinstance(obj, (list, tuple)):
            return sum(held_bytes(o, seen, visited) for o in obj)
        if hasattr(obj, "__dict__"):
            return sum(held_bytes(o, seen, visited) for o in vars(obj).values())
        return 0

    path, fmt = sys.argv[1], sys.argv[2]
    keep_freed_memory()  # what a worker's configure_process sets before it loads
    loaded = load_model(path)
    np.frombuffer(loaded.mapping, np.uint8)[::4096].sum()  # map every file page now
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the RSS now
    before = status()
    with loading_weights():
        model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, fmt)
        built = status()
    after = status()
    rows = [w.shape for n, w in loaded.weights.items() if n.endswith("proj.weight")]
    print(json.dumps({
        "peak_anon": after["VmHWM"] - before["RssFile"] - before["RssAnon"],
        "built_anon": built["RssAnon"] - before["RssAnon"],
        "held": held_bytes(model, set()),
        "largest_fp32": max(4 * r * c for r, c in rows),
        "layers": loaded.config.num_layers,
    }))
""")


def _measure(path: Path, fmt: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), fmt], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _model(tmp_path_factory, layers: int) -> Path:
    # 512 x 2048 matrices: each layer's fp32 temporaries (~30 MB for w8a8) are large against
    # the packed layer (~4 MB), so keeping every layer's is far past the bound below.
    path = tmp_path_factory.mktemp("loadmem") / f"q8-{layers}.gguf"
    make_tiny_gguf(path, "Q8_0", vocab_size=512, hidden=512, layers=layers, heads=8, kv_heads=4,
                   intermediate=2048)
    return path


@pytest.fixture(scope="module")
def q8_models(tmp_path_factory) -> tuple[Path, Path]:
    return _model(tmp_path_factory, 2), _model(tmp_path_factory, 8)


@pytest.mark.parametrize("fmt", ["w8a8", "int4"])
def test_load_peak_does_not_grow_with_layers(q8_models: tuple[Path, Path], fmt: str) -> None:
    """Peak anonymous memory past what the model holds is a one-time overhead (interpreter,
    torch's first ops) plus one matrix's temporaries: the same for 2 layers as for 8."""
    small, large = (_measure(path, fmt) for path in q8_models)
    excess = [m["peak_anon"] - m["held"] for m in (small, large)]
    assert excess[1] - excess[0] <= 2 * large["largest_fp32"] + (8 << 20), (small, large)
    # What the build leaves before its trim: the model, not its temporaries.
    left = [m["built_anon"] - m["held"] for m in (small, large)]
    assert left[1] - left[0] <= large["largest_fp32"] + (8 << 20), (small, large)
