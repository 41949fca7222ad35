"""Start a tandem topology on this host: a coordinator and its workers, one process each.

    topology = Topology(model="smollm2", model_path=path, prefill=1, decode=1)  # deploy/local_topology.py
    specs, ready = plan(topology)          # deploy/process_plan.py: argv of every process, ports
    with LocalCluster(specs, ready) as cluster:
        cluster.start()                     # waits until the coordinator reports the workers
        cluster.wait()                      # until Ctrl-C / SIGTERM; restarts workers that exit

Start order: the coordinator first (workers register with it), then the workers. Ready means
the coordinator answers HTTP and GET /internal/workers lists the expected live workers by role.
If a process exits during start-up, the others are stopped and LaunchError names it with the
tail of its log. While serving, a worker that exits is logged with its log's tail and started
again after a backoff (1, 2, 4, ... 30 s; it re-registers by itself) while the rest serve on;
one that keeps dying right after each start is given up on, and then everything stops, as it
does when the coordinator exits. Only Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops a
healthy cluster; a second one kills every process at once. Stopping sends SIGTERM to the
workers, then the coordinator, within one `grace_s` for all, then SIGKILLs what is left, logs
how each ended and removes the shared-memory KV segments of its workers, whatever killed them.
Children run in process groups of their own, so the terminal's signals reach only this
launcher, which forwards them in that order (local tandem processes stay in its session, a
wrapper such as ssh or sudo gets a session of its own: OWN_PROCESS_GROUP below).

Children die with the launcher: each watches a lifeline pipe (common/lifeline.py) and stops
itself when the launcher is gone, SIGKILL and OOM kills included; a child that is not a tandem
process (the ssh client of a remote role) gets a parent-death signal instead. `serve` claims
the coordinator's ports first (deploy/ports.py): a second cluster on them fails at start.

Core lease: where prefill and decode workers both run (Topology.shares_cores, on unless
core_lease=False), `serve` makes the host's core lease (common/core_lease.py) before the
workers start, gives each worker its slot (--core-lease, --core-lease-slot), and removes it
after they have stopped; a decode worker then runs its native kernels on the cores of idle
prefill workers too (worker/core_share.py).

Logs: one file per process under `log_dir` (`coordinator.log`, `prefill-0.log`, ...).

`tandem launch` (deploy/launch.py) reuses LocalCluster for other hosts: its specs wrap each
command in ssh or a command prefix, and a spec's `signal_argv` reaches a process that ssh
started on the far side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import TandemError
from common.internal_http import get_internal
from common.lifeline import Lifeline, death_signal
from common.core_lease import CoreLease, lease_path, reclaim_stale as reclaim_stale_leases
from common.shm_segments import reclaim_orphans
from deploy.ports import claim_ports
from deploy.process_plan import ProcessSpec, Readiness, plan, registry_port_of
from deploy.local_topology import Topology
from worker.runtime import worker_env

# Each child in a process group of its own (the terminal's Ctrl-C reaches the launcher alone,
# which stops the children in order) but in the launcher's session. A session of its own
# (setsid, what this did before) is also a scheduling group of its own where the kernel's
# autogroup is on (CONFIG_SCHED_AUTOGROUP, /proc/sys/kernel/sched_autogroup_enabled: the
# default of most distributions' kernels): the CPU is then shared between sessions before
# threads, and with the workers outnumbering the cores a decode worker's engine thread that
# woke waited 44-93 ms on the run queue while the prefill worker and the other decode worker
# held both cores (`perf sched timehist`; README, stop 46). One session keeps the sharing
# between the workers' threads. (Python 3.10 has no process_group: a session there.)
OWN_PROCESS_GROUP = ({"process_group": 0} if sys.version_info >= (3, 11)
                     else {"start_new_session": True})


def session_of(spec: ProcessSpec) -> dict[str, object]:
    """Popen's grouping for a child: a local tandem process (this Python) joins the launcher's
    session in a group of its own; a wrapper (ssh, `sudo ip netns exec`: another host, in
    effect) gets a session of its own and so no terminal, where a prompt fails at once
    instead of stopping it in the background (SIGTTIN) until the start-up timeout."""
    local = bool(spec.argv) and spec.argv[0] == sys.executable
    return OWN_PROCESS_GROUP if local else {"start_new_session": True}


class LaunchError(TandemError):
    """A process of the topology failed to start, or the topology never became ready."""


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen
    log: object = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    quick_failures: int = 0  # consecutive exits soon after a start
    restart_at: float | None = None  # set while a restart waits out its backoff
    # The model loaded on request this worker serves (deploy/model_supervisor.py), else None:
    # such a worker given up on stops only its model, never the cluster.
    model: str | None = None
    exits: list[tuple[int, str]] = field(default_factory=list)  # (code, log tail) while serving
    given_up: bool = False
    pids: list[int] = field(default_factory=list)  # every process started for it

    def __post_init__(self) -> None:
        self.pids.append(self.process.pid)


class LocalCluster:
    # Supervision while serving: a worker that exits is started again after a backoff (it
    # re-registers with the coordinator by itself), the coordinator and the other workers
    # serving on. A worker that keeps exiting within `quick_s` of its start more than
    # `max_quick_failures` times in a row is given up on, and then the cluster stops (it will
    # not come up: a wrong model, a refused layout). The coordinator exiting stops the cluster;
    # one of several coordinators (Readiness.more_urls) is restarted like a worker.
    def __init__(self, specs: list[ProcessSpec], ready: Readiness, *,
                 start_timeout_s: float = 300.0, grace_s: float = 10.0,
                 env: dict[str, str] | None = None,
                 restart_backoff_s: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0),
                 max_quick_failures: int = 5, quick_s: float = 10.0) -> None:
        self.restart_backoff_s = restart_backoff_s
        self.max_quick_failures = max_quick_failures
        self.quick_s = quick_s
        self.out: Callable[[str], None] = print
        self.specs = specs
        self.ready = ready
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        # One torch thread per process and passive OpenMP waits: several workers share a host.
        self.env = {**(worker_env() if env is None else env), "PYTHONUNBUFFERED": "1"}
        self.children: list[_Child] = []
        # Held while the list changes or is walked: the supervisor channel's threads add and
        # remove the workers of models loaded on request while the main thread supervises.
        self.children_lock = threading.RLock()
        self.stop_requested = threading.Event()
        self.lifeline = Lifeline()  # the children's tie to this process
        self.pids: list[int] = []  # every process started, restarts included

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start every process and wait until the topology is ready (LaunchError if not)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start every process without waiting; `wait_ready` waits (the launcher records the
        processes in between, so that `tandem launch --down` can find them)."""
        for spec in self.specs:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab")
            self.children.append(_Child(spec, self._popen(spec, log), log))

    def respawn(self, name: str) -> subprocess.Popen:
        """Start the named process again with its own argv and log (it must have exited): the
        chaos suite's restart of a killed role, without the supervisor's backoff."""
        child = next(c for c in self.children if c.spec.name == name)
        if child.process.poll() is None:
            raise LaunchError(f"{name} is still running (pid {child.process.pid})")
        child.process = self._popen(child.spec, child.log)
        child.pids.append(child.process.pid)
        child.started, child.restart_at = time.monotonic(), None
        return child.process

    def _popen(self, spec: ProcessSpec, log) -> subprocess.Popen:
        # A tandem process watches the lifeline; an ssh client cannot, so it gets the death
        # signal, which is tied to the forking thread: only from the main thread.
        preexec = (death_signal() if spec.signal_argv
                   and threading.current_thread() is threading.main_thread() else None)
        process = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
                                   **session_of(spec),
                                   env={**self.env, **self.lifeline.child_env(), **dict(spec.env)},
                                   pass_fds=(*self.lifeline.pass_fds, *spec.pass_fds),
                                   preexec_fn=preexec)
        if spec.stdin:  # a few bytes: the pipe's buffer holds them, nothing blocks
            try:
                process.stdin.write(spec.stdin)
                process.stdin.close()
            except BrokenPipeError:
                pass  # it exited at once; the supervisor reports it
        self.pids.append(process.pid)
        return process

    def wait_ready(self) -> None:
        """Wait until the coordinator reports the expected workers; on failure or interrupt,
        stop every process and raise LaunchError."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while True:
            self._check_children("during start-up")
            if self.stop_requested.is_set():
                raise LaunchError("start-up interrupted")
            live = self._live_workers()
            if isinstance(live, tuple):
                counts, ids = live
                missing = [w for w in self.ready.worker_ids if w not in ids]
                if not missing and all(counts.get(role, 0) >= n
                                       for role, n in self.ready.expected.items()):
                    return
                last = f"live workers {counts}, expected {self.ready.expected}" + (
                    f", not yet registered: {', '.join(missing)}" if missing else "")
            else:
                last = live
            if time.monotonic() > deadline:
                raise LaunchError(f"the topology was not ready within {self.start_timeout_s:g} s "
                                  f"({last}); logs are in {self.specs[0].log_path.parent}")
            self.stop_requested.wait(0.25)

    def _live_workers(self) -> tuple[dict[str, int], set[str]] | str:
        """(live counts by role, ids of live workers) that every coordinator reports (the
        least of each count, the ids all list), or why one did not say."""
        counts: dict[str, int] | None = None
        ids: set[str] | None = None
        for url in self.ready.urls:
            try:
                # Over https get_internal does not check the certificate: it is made for the
                # names clients use, maybe not for this address, and the answer is only a
                # count of live workers, from a process this launcher started.
                report = get_internal(url, self.ready.secret, timeout=2)
                live = {w["worker_id"] for w in report["workers"] if w["alive"]}
                counts = report["live"] if counts is None else {
                    role: min(n, report["live"].get(role, 0)) for role, n in counts.items()}
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
                return f"coordinator{'' if len(self.ready.urls) == 1 else ' ' + url} not answering: {exc}"
            ids = live if ids is None else ids & live
        return counts, ids

    def _check_children(self, when: str) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise LaunchError(f"{child.spec.name} exited with code {code} {when}; last lines "
                                  f"of {child.spec.log_path}:\n{log_tail(child.spec.log_path)}")

    def wait(self, poll_s: float = 0.5) -> str | None:
        """Serve until stop is requested (None), restarting workers that exit; or until the
        coordinator exits or a worker is given up on (why, as text)."""
        while not self.stop_requested.wait(poll_s):
            failure = self._supervise()
            if failure is not None:
                return failure
        return None

    def _supervise(self) -> str | None:
        with self.children_lock:
            return self._supervise_locked()

    def _supervise_locked(self) -> str | None:
        now = time.monotonic()
        for i, child in enumerate(self.children):
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.process = self._popen(child.spec, child.log)
                    child.pids.append(child.process.pid)
                    child.started, child.restart_at = now, None
                    self.out(f"restarted {child.spec.name} (pid {child.process.pid})")
                continue
            code = child.process.poll()
            if code is None or child.given_up:
                continue
            tail = log_tail(child.spec.log_path)
            why = (f"{child.spec.name} exited with code {code} while serving; last lines of "
                   f"{child.spec.log_path}:\n{tail}")
            if i == 0 and len(self.ready.urls) == 1:  # the workers cannot serve without it
                return why
            if child.model is not None:
                child.exits.append((code, tail))  # the coordinator asks (a failed load)
            # A worker, or one of several coordinators (the others serve on; the workers
            # register with it again by themselves): restarted after a backoff.
            child.quick_failures = child.quick_failures + 1 if now - child.started < self.quick_s else 1
            if child.quick_failures > self.max_quick_failures:
                gave_up = (f"{why}\n{child.spec.name} exited within {self.quick_s:g} s of "
                           f"starting {child.quick_failures} times in a row; not restarting it")
                if child.model is None:
                    return gave_up
                child.given_up = True  # its model alone is lost; its coordinator unloads it
                self.out(gave_up)
                continue
            delay = self.restart_backoff_s[min(child.quick_failures, len(self.restart_backoff_s)) - 1]
            child.restart_at = now + delay
            self.out(f"{why}\nrestarting {child.spec.name} in {delay:g} s")
        return None

    def stop(self) -> None:
        """Workers first (so none re-registers with a vanishing coordinator), coordinator last,
        all within one grace period; then SIGKILL. Logs how each ended; removes the workers'
        shared-memory segments that are left."""
        with self.children_lock:
            children = list(self.children)
        deadline = time.monotonic() + self.grace_s
        ended = []
        # The coordinator gets a second at least, even after slow workers.
        n = len(self.ready.urls)
        for floor_s, group in ((0.0, children[n:]), (1.0, children[:n])):
            ended += self._end(group, deadline, floor_s)
        for child in children:
            child.log.close()
        removed = reclaim_orphans(owners=self.pids)
        if ended or removed:
            self.out(f"stopped {', '.join(ended) or 'nothing (every process had exited)'}"
                     + (f"; removed shared memory {', '.join(removed)}" if removed else ""))

    def _end(self, group: list[_Child], deadline: float, floor_s: float = 0.0) -> list[str]:
        """SIGTERM to the running processes of `group`, SIGKILL to those still there at
        `deadline`; how each ended."""
        ended = []
        running = [c for c in group if c.process.poll() is None]
        for child in running:
            self._signal(child, signal.SIGTERM)
        for child in running:
            try:
                child.process.wait(max(floor_s, deadline - time.monotonic()))
                how = f"exit {child.process.returncode}"
            except subprocess.TimeoutExpired:
                self._signal(child, signal.SIGKILL)
                _signal(child.process, signal.SIGKILL)
                how = f"SIGKILL after {self.grace_s:g} s"
                try:
                    child.process.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    how += ", still not gone"
            ended.append(f"{child.spec.name} (pid {child.process.pid}, {how})")
        return ended

    # ---- the workers of models loaded on request (deploy/model_supervisor.py) -------------------

    def add_model(self, model: str, specs: list[ProcessSpec]) -> None:
        """Start a model's workers while serving; supervised as the others, except that one
        given up on stops only its model."""
        with self.children_lock:
            if self.stop_requested.is_set():
                raise LaunchError("the cluster is stopping")
            for spec in specs:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(spec.log_path, "ab")
                self.children.append(_Child(spec, self._popen(spec, log), log, model=model))

    def model_children(self, model: str) -> list[_Child]:
        with self.children_lock:
            return [c for c in self.children if c.model == model]

    def remove_model(self, model: str) -> tuple[list[str], list[str]]:
        """Stop a model's workers (SIGTERM, SIGKILL after grace_s) and forget them; (how each
        ended, the shared-memory KV segments of theirs removed)."""
        with self.children_lock:
            group = [c for c in self.children if c.model == model]
            self.children = [c for c in self.children if c.model != model]
        ended = self._end(group, time.monotonic() + self.grace_s)
        for child in group:
            child.log.close()
        # Every pid of theirs, restarts included: the segments a killed worker left behind.
        return ended, reclaim_orphans(owners=[pid for c in group for pid in c.pids])

    def kill_now(self) -> None:
        """SIGKILL every process at once (a second Ctrl-C); stop() then reaps them."""
        for child in self.children:
            if child.process.poll() is None:
                self._signal(child, signal.SIGKILL)
                _signal(child.process, signal.SIGKILL)

    def _signal(self, child: _Child, sig: int) -> None:
        if not child.spec.signal_argv:
            _signal(child.process, sig)
            return
        name = signal.Signals(sig).name.removeprefix("SIG")
        argv = [a.replace("{signal}", name) for a in child.spec.signal_argv]
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=self.grace_s, env=self.env)
        except (OSError, subprocess.TimeoutExpired):
            # The remote side is out of reach; ending the local end (ssh) is all that is left.
            _signal(child.process, sig)


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass


def serve(topology: Topology, *, start_timeout_s: float = 300.0,
          out: Callable[[str], None] = print, lock_dir: Path | None = None,
          more_ports: tuple[int, ...] = (), supervisor_factory=None) -> int:
    """Run a topology until Ctrl-C, SIGTERM or SIGHUP; 0 on a requested stop, 1 if a process
    failed. First claims the HTTP port and `more_ports` (the coordinator's other listening
    ports on its host; locks in `lock_dir`): PortInUse if one is held, nothing started.
    supervisor_factory(topology, registry_port): the coordinator's supervisor channel
    (deploy/model_supervisor.ModelSupervisor, for topology.load_on_request)."""
    with claim_ports(lock_dir, (topology.port, *more_ports), topology.host):
        lease = make_core_lease(topology, out)
        try:
            return _serve(topology, start_timeout_s, out, lease, supervisor_factory)
        finally:  # every worker has stopped by now (run_until_stopped)
            if lease is not None:
                lease.unlink()


def make_core_lease(topology: Topology, out: Callable[[str], None] = print) -> CoreLease | None:
    """The host's core lease for the topology's workers (None where it shares no cores),
    after reclaiming the leases of launchers that are gone."""
    if not topology.shares_cores:
        return None
    stale = reclaim_stale_leases()
    if stale:
        out(f"removed the core leases of gone launchers: {', '.join(stale)}")
    return CoreLease.create(lease_path(str(topology.port)), topology.core_slots(), loading_pid=os.getpid())


def _serve(topology: Topology, start_timeout_s: float, out: Callable[[str], None],
           lease: CoreLease | None = None, supervisor_factory=None) -> int:
    specs, ready = plan(topology, core_lease=lease.path if lease else None)
    supervisor = None
    if supervisor_factory is not None:
        supervisor = supervisor_factory(topology, registry_port_of(specs[0]))
        specs[0] = supervisor.attach(specs[0])
    # OpenMP reads its thread count when torch starts, before a worker's own --threads.
    cluster = LocalCluster(specs, ready, start_timeout_s=start_timeout_s,
                           env=worker_env(topology.threads or 1))
    if supervisor is not None:
        supervisor.cluster = cluster

    def on_ready() -> None:
        out(f"tandem is serving {', '.join(n for n, _ in topology.models)} at {ready.url}  (Ollama API: "
            f"{ready.url}/api/chat, metrics: {ready.url}/metrics); Ctrl-C stops it")
        for spec in specs[1:]:
            out(f"  {spec.name}: {' '.join(spec.argv[2:])}")

    out(f"starting {', '.join(s.name for s in specs)}; logs in {topology.log_dir}")
    try:
        return run_until_stopped(cluster, on_ready, out, on_spawn=supervisor.serve_in_background
                                 if supervisor is not None else None)
    finally:
        if supervisor is not None:
            supervisor.close()


def run_until_stopped(cluster: LocalCluster, on_ready: Callable[[], None],
                      out: Callable[[str], None] = print,
                      on_spawn: Callable[[], None] | None = None) -> int:
    """Start `cluster`, call on_ready, serve until SIGINT/SIGTERM/SIGHUP (0) or until a process
    exits (1); 130 when interrupted during start-up. Every process is stopped on the way out;
    a second signal kills them at once. on_spawn runs once every process has been started,
    before waiting for readiness."""
    cluster.out = out

    def on_signal(sig: int, _frame) -> None:
        name = signal.Signals(sig).name
        if cluster.stop_requested.is_set():
            out(f"{name} again: killing every process now")
            cluster.kill_now()
        else:
            out(f"{name}: stopping every process (send it again to kill them at once)")
            cluster.stop_requested.set()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        with cluster:
            try:
                cluster.spawn()
                if on_spawn is not None:
                    on_spawn()
                cluster.wait_ready()
            except LaunchError:
                if cluster.stop_requested.is_set():
                    out("interrupted during start-up; stopped every process")
                    return 130
                raise
            on_ready()
            failure = cluster.wait()
            if failure:
                out(f"stopping: {failure}")
                return 1
            out("stopping")
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
