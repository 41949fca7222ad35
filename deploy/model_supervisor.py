"""The launcher's side of the supervisor channel (common/supervisor_wire.py): `tandem serve
--load-on-request` starts and stops the workers of models loaded on request when its
coordinator asks (coordinator/on_demand.py decides what and when; this only does it).

    serve(topology, supervisor_factory=ModelSupervisor)   # deploy/local.py does, in order:
    supervisor = ModelSupervisor(topology, registry_port)
    specs[0] = supervisor.attach(specs[0])  # the coordinator: its end of the channel, by number
    supervisor.cluster = LocalCluster(specs, ...); spawn; supervisor.serve_in_background()

A model's workers are as a model given with --model gets them: `prefill`/`decode` of them (or
one colocated; `--workers MODEL=P:D` counts where one names it), the topology's engine flags,
named after the model (`qwen3-0-6b-decode-0`);
no core lease slot (the lease's slots are fixed at start). They are children of the cluster
like the others, restarted when they exit; one given up on is left down and reported, its
model unloaded by its coordinator rather than the whole cluster stopped.

Each request is answered on a thread of its own, so a stop (which waits for processes to end)
never holds up another model's start.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import replace
from pathlib import Path

from common.supervisor_wire import ENV_FD, MAX_LINE, Request, decode_request, encode
from deploy.local import LocalCluster
from deploy.process_plan import ProcessSpec, worker_spec
from deploy.local_topology import Topology, model_slug


class ModelSupervisor:
    def __init__(self, topology: Topology, registry_port: int) -> None:
        self.cluster: LocalCluster | None = None  # set before serve_in_background
        self.topology = topology
        self.registry_port = registry_port
        self._ours, self._theirs = socket.socketpair()
        self._write_lock = threading.Lock()
        self._models_lock = threading.Lock()  # one start or stop of a model's workers at a time
        self._thread: threading.Thread | None = None

    def attach(self, coordinator: ProcessSpec) -> ProcessSpec:
        """The coordinator's spec with its end of the channel (inherited by number)."""
        fd = self._theirs.fileno()
        return replace(coordinator, pass_fds=(*coordinator.pass_fds, fd),
                       env=(*coordinator.env, (ENV_FD, str(fd))))

    def serve_in_background(self) -> None:
        """Answer the coordinator's requests until it closes its end (it exited)."""
        self._theirs.close()  # the coordinator holds its own copy now
        self._thread = threading.Thread(target=self._serve, name="model-supervisor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._ours.close()

    # ---- the channel ----------------------------------------------------------------------------

    def _serve(self) -> None:
        with self._ours.makefile("rb") as lines:
            while True:
                try:
                    line = lines.readline(MAX_LINE)
                except OSError:
                    return
                if not line:
                    return
                threading.Thread(target=self._answer, args=(line,), daemon=True).start()

    def _answer(self, line: bytes) -> None:
        try:
            request = decode_request(line)
        except (ValueError, KeyError, TypeError) as exc:
            self.cluster.out(f"supervisor channel: a malformed request ({exc})")
            return
        try:
            reply = self.handle(request)
        except Exception as exc:  # the reason goes back; the coordinator fails that load
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        with self._write_lock:
            try:
                self._ours.sendall(encode({"id": request.id, **reply}))
            except OSError:
                pass  # the coordinator is gone; the cluster stops

    def handle(self, request: Request) -> dict:
        if request.op == "start":
            return {"workers": self.start(request.model, Path(request.path))}
        if request.op == "status":
            return {"exits": [{"worker": c.spec.name, "code": code, "log_tail": tail}
                              for c in self.cluster.model_children(request.model)
                              for code, tail in c.exits]}
        ended, freed = self.stop(request.model)
        return {"stopped": ended, "freed": freed}

    # ---- a model's workers ----------------------------------------------------------------------

    def start(self, model: str, path: Path) -> list[str]:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such model file or directory")
        with self._models_lock:
            if self.cluster.model_children(model):
                raise RuntimeError(f"the workers of {model} are running already")
            specs = self.specs(model, path)
            self.cluster.add_model(model, specs)
        names = [s.name for s in specs]
        self.cluster.out(f"loading {model} on request: started {', '.join(names)}")
        return names

    def stop(self, model: str) -> tuple[list[str], list[str]]:
        with self._models_lock:
            ended, freed = self.cluster.remove_model(model)
        self.cluster.out(f"unloaded {model}: stopped {', '.join(ended) or 'nothing'}"
                         + (f"; removed shared memory {', '.join(freed)}" if freed else ""))
        return ended, freed

    def specs(self, model: str, path: Path) -> list[ProcessSpec]:
        """The model's workers, with names no running process of the cluster has."""
        t = self.topology
        prefill, decode = t.counts_for(model)
        roles = ([("colocated", "decode_node")] if t.colocated else
                 [("prefill", "prefill_node")] * prefill + [("decode", "decode_node")] * decode)
        with self.cluster.children_lock:
            taken = {c.spec.name for c in self.cluster.children}
        for n in range(1, len(taken) + 2):  # a free prefix exists among these
            # A second number when another model with the same slug runs (a:b and a-b).
            prefix = model_slug(model) if n == 1 else f"{model_slug(model)}-{n}"
            counters: dict[str, int] = {}
            names = []
            for role, _ in roles:
                index = counters[role] = counters.get(role, -1) + 1
                names.append(f"{prefix}-{role}-{index}")
            if not taken & set(names):
                break
        return [worker_spec(t, name, path, role, module, self.registry_port)
                for name, (role, module) in zip(names, roles)]

