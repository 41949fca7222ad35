"""A real tandem cluster for tests: coordinator and workers as separate processes on
127.0.0.1 (deploy.local), with helpers to talk to it and to read every worker's KV pool."""

from __future__ import annotations

import json
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.internal_http import get_internal
from deploy.local import LocalCluster
from deploy.process_plan import free_port, plan
from deploy.local_topology import Topology


@dataclass
class Cluster:
    url: str
    handle: LocalCluster
    log_dir: Path

    def workers(self) -> list[dict]:
        return get_internal(self.url, self.handle.ready.secret)["workers"]

    def wait_pools_full(self, timeout_s: float = 20.0) -> list[dict]:
        """Waits until every live worker reports all KV blocks free (heartbeats carry the
        counts, so this polls); returns the last snapshot, which the caller asserts on."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = [w for w in self.workers() if w["alive"]]
            if all(w["num_free_blocks"] == w["num_blocks"] for w in workers) or time.monotonic() > deadline:
                return workers
            time.sleep(0.1)

    def chat(self, messages: list[dict], timeout: float = 120, **body) -> dict:
        data = json.dumps({"model": body.pop("model", "tiny"), "messages": messages, "stream": False, **body})
        req = urllib.request.Request(self.url + "/api/chat", data=data.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


@contextmanager
def running_cluster(model_path: Path, log_dir: Path, *, model: str = "tiny", prefill: int = 1,
                    decode: int = 1, colocated: bool = False, kv_backend: str = "zmq",
                    chunk_size: int = 256, prefill_threshold: int | None = None,
                    worker_args: tuple[str, ...] = (), coordinator_args: tuple[str, ...] = (),
                    start_timeout_s: float = 120.0, cluster_secret: str | None = None,
                    auth_args: tuple[str, ...] = (),
                    more_models: tuple[tuple[str, Path], ...] = (),
                    store_name: str | None = None, batch_invariant: bool = False):
    """more_models: (name clients use, path) of more models served by the same cluster, each
    with workers of its own (deploy/local.py), as `tandem serve --model A --model B` runs.
    store_name: what the coordinator is given as --model (a name it resolves in its stores to
    `model_path`, as `tandem serve NAME` does); by default the path itself."""
    names = tuple(a for name, _ in more_models for a in ("--model-name", name))
    topology = Topology(model=store_name or str(model_path), model_path=model_path,
                        more_models=tuple((str(path), path) for _, path in more_models),
                        log_dir=log_dir, port=free_port(), prefill=prefill, decode=decode,
                        colocated=colocated, kv_backend=kv_backend, chunk_size=chunk_size,
                        prefill_threshold=prefill_threshold, worker_args=worker_args,
                        coordinator_args=("--model-name", model, *names, *coordinator_args),
                        cluster_secret=cluster_secret, auth_args=auth_args,
                        batch_invariant=batch_invariant)
    log_dir.mkdir(parents=True, exist_ok=True)
    specs, ready = plan(topology)
    handle = LocalCluster(specs, ready, start_timeout_s=start_timeout_s)
    with handle:
        handle.start()
        yield Cluster(ready.url, handle, log_dir)
