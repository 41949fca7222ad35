"""common/malloc_policy.freeze_loaded_heap: what a process holds once loaded leaves the cyclic
GC's full collections, while garbage made afterwards is still collected, and the process still
exits cleanly (its frozen objects are unfrozen at exit). In a child process: freezing is
process-wide, and the test process must not keep what it would freeze."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import gc, json
from common.malloc_policy import freeze_loaded_heap

gc.disable()  # only the explicit collections below run, so their counts are exact

class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic GC could ever free it

loaded = [Node() for _ in range(50_000)]
gc.collect()
before = gc.get_freeze_count()
frozen = freeze_loaded_heap()
# A second call adds what is new since, and registers no second exit hook.
frozen_again = freeze_loaded_heap()
for _ in range(1000):
    Node()  # cyclic garbage made after the freeze
collected = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "again": frozen_again,
                  "collected": collected, "tracked": len(gc.get_objects())}))
"""


def test_freeze_keeps_loaded_objects_out_of_full_collections():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout)
    assert got["before"] == 0
    assert got["frozen"] >= 50_000 and got["again"] >= got["frozen"]
    # A full collection walks only what is not frozen: the 50,000 loaded cycles are not among
    # the objects it tracks, and the 1,000 made afterwards were freed.
    assert got["tracked"] < 50_000
    assert got["collected"] == 1000
    assert out.stderr == ""  # a clean exit
