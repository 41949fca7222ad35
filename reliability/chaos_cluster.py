"""The cluster the chaos suite and the soak drive: a real coordinator (or several), prefill and
decode processes (deploy.local), with a FaultProxy on every decode worker's KV link, and streaming
clients whose every reply is judged against a reference answer.

    prefill-i --zmq--> FaultProxy 127.0.0.2:K --zmq--> decode-j's receiver 127.0.0.1:K
                       (decode-j advertises tcp://127.0.0.2:K with --kv-advertise)

The proxy reads the plaintext ZMTP stream for its phase markers, so it stands only on the zmq
backend without the secure plane. With another backend (shm, grpc, dist), or `secure` (a
cluster secret, mutual TLS on the internal gRPC plane from a throwaway CA, and so CURVE on
zmq), the KV links run direct and the suite reads the phases from the coordinator's worker
stats instead (chaos_scenarios.py); the link faults need the proxy and are left out.

A reply is one of (Reply.verdict):
    correct      the stream finished and its text is the reference text
    clear_error  an HTTP error, an error line, or a stream the server closed before `done`
                 (its coordinator was killed), and the text so far is a prefix of the reference
    wrong        anything else that finished: a different text (must never happen)
    hung         no end within the client's deadline
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.internal_http import get_internal
from reliability.fault_proxy import FaultProxy
from deploy.local import LocalCluster
from deploy.process_plan import free_port, plan
from deploy.local_topology import Topology

PROXY_HOST = "127.0.0.2"  # any 127/8 address reaches lo; the proxy owns this one's KV ports


@dataclass
class Reply:
    status: int | None = None
    text: str = ""
    lines: int = 0
    done: bool = False
    error: str | None = None
    cut: bool = False  # the connection ended before a `done` line
    final: dict | None = None
    retry_after: str | None = None
    first_at: float | None = None  # monotonic time of the first content line
    finished: threading.Event = field(default_factory=threading.Event, repr=False)

    def verdict(self, expected: str) -> str:
        if not self.finished.is_set():
            return "hung"
        if self.done and self.error is None:
            return "correct" if self.text == expected else "wrong"
        if (self.error is not None or self.cut) and expected.startswith(self.text):
            return "clear_error"
        return "wrong"


class Stream(threading.Thread):
    """One streaming /api/chat request on its own thread; `reply` fills in as lines arrive.
    read_delay_s makes it a slow reader; disconnect_after closes it after that many lines."""

    def __init__(self, url: str, content: str, num_predict: int, timeout_s: float = 120.0,
                 read_delay_s: float = 0.0, disconnect_after: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.content, self.num_predict = url, content, num_predict
        self.timeout_s, self.read_delay_s, self.disconnect_after = timeout_s, read_delay_s, disconnect_after
        self.reply = Reply()

    def run(self) -> None:
        r = self.reply
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        body = json.dumps({"model": "chaos", "stream": True,
                           "messages": [{"role": "user", "content": self.content}],
                           "options": {"temperature": 0, "num_predict": self.num_predict}})
        try:
            conn.request("POST", "/api/chat", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            r.status, r.retry_after = resp.status, resp.getheader("Retry-After")
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace')}"
                return
            while line := resp.readline():
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "error" in msg:
                    r.error = str(msg["error"])
                    return
                r.text += msg.get("message", {}).get("content", "")
                r.lines += 1
                if r.first_at is None:
                    r.first_at = time.monotonic()
                if msg.get("done"):
                    r.done, r.final = True, msg
                    return
                if self.disconnect_after is not None and r.lines >= self.disconnect_after:
                    r.error = "client disconnected"
                    return
                if self.read_delay_s:
                    time.sleep(self.read_delay_s)
            r.cut = True
        except (OSError, http.client.HTTPException, ValueError) as exc:
            r.cut, r.error = True, r.error or f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
            r.finished.set()


@dataclass(frozen=True)
class ChaosTopology:
    model_path: Path
    log_dir: Path
    prefill: int = 2
    decode: int = 2
    chunk_size: int = 64
    max_running_per_worker: int = 2  # small, so a few streams fill the cluster (queued phase)
    max_queue: int = 8
    # A transfer that lost its data fails at the decode worker's deadline: shorter than the
    # default (330 s) so that the suite measures recovery in seconds, not minutes.
    kv_deadline_s: float = 20.0
    worker_args: tuple[str, ...] = ("--decode-quant", "fp32", "--prefill-quant", "fp32",
                                    "--kv-cache-gb", "0.05")
    coordinator_args: tuple[str, ...] = ()
    # More than one: coordinator-1... beside the first ("coordinator"), each on ports of its
    # own, every worker registered with all (`--coordinator A,B`), as `tandem launch` starts
    # [[coordinator]] tables; the suite's requests go to the first unless a scenario says.
    coordinators: int = 1
    kv_backend: str = "zmq"
    # The internal plane as an operator hardens it: a cluster secret (KV keys, CURVE on zmq,
    # call proofs) and mutual TLS on every internal gRPC server, from a CA made for the run.
    secure: bool = False

    @property
    def link_proxies(self) -> bool:
        """Whether each decode worker's KV link goes through a FaultProxy (see the docstring)."""
        return self.kv_backend == "zmq" and not self.secure


def _secure_plane(log_dir: Path) -> tuple[str, tuple[str, ...]]:
    """(a new cluster secret, the TLS flags every process gets) for a run on this host. The
    certificate names the proxies' address too: workers reach the Registry through them."""
    import secrets

    from deploy.cluster_ca import issue, make_ca

    folder = log_dir / "tls"
    issued = issue(folder, make_ca(folder), "loopback", addresses=("127.0.0.1", PROXY_HOST))
    return secrets.token_hex(32), ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key),
                                   "--tls-ca", str(issued.ca))


def _more_coordinators(specs: list, ready, n: int, log_dir: Path):
    """The plan with n - 1 more coordinators after the first (same flags, own ports); every
    worker's --coordinator lists them all; ready waits for each (Readiness.more_urls)."""
    first = specs[0]
    added, urls, registries = [], [], []
    for i in range(1, n):
        argv = list(first.argv)
        port, registry = free_port(), free_port()
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--registry-port") + 1] = str(registry)
        added.append(replace(first, name=f"coordinator-{i}", argv=argv,
                             log_path=log_dir / f"coordinator-{i}.log"))
        urls.append(ready.url.rsplit(":", 1)[0] + f":{port}")
        registries.append(f"127.0.0.1:{registry}")
    for spec in specs[1:]:
        at = spec.argv.index("--coordinator") + 1
        spec.argv[at] = ",".join([spec.argv[at], *registries])
    return [first, *added, *specs[1:]], replace(ready, more_urls=tuple(urls))


class ChaosCluster:
    def __init__(self, t: ChaosTopology) -> None:
        self.t = t
        t.log_dir.mkdir(parents=True, exist_ok=True)
        secret, auth_args = _secure_plane(t.log_dir) if t.secure else (None, ())
        topology = Topology(model=str(t.model_path), model_path=t.model_path, log_dir=t.log_dir,
                            port=free_port(), prefill=t.prefill, decode=t.decode,
                            kv_backend=t.kv_backend, chunk_size=t.chunk_size, prefill_threshold=1,
                            worker_args=t.worker_args, cluster_secret=secret, auth_args=auth_args,
                            coordinator_args=("--model-name", "chaos", "--max-running-per-worker",
                                              str(t.max_running_per_worker), "--max-queue",
                                              str(t.max_queue), *t.coordinator_args))
        specs, self.ready = plan(topology)
        if t.coordinators > 1:
            specs, self.ready = _more_coordinators(specs, self.ready, t.coordinators, t.log_dir)
        self.url = self.ready.url
        self.urls = self.ready.urls  # every coordinator's, the first's first
        self.proxies: dict[str, FaultProxy] = {}
        self._awaiting: dict[str, int] = {}  # worker -> registrations logged when it was cut off
        for spec in specs:
            if spec.name.startswith("decode") and not t.link_proxies:
                spec.argv.extend(["--kv-deadline", str(t.kv_deadline_s)])
            elif spec.name.startswith("decode"):
                kv_port = free_port()
                spec.argv.extend(["--kv-port", str(kv_port), "--kv-deadline", str(t.kv_deadline_s),
                                  "--kv-advertise", f"tcp://{PROXY_HOST}:{kv_port}"])
                self.proxies[spec.name] = FaultProxy("127.0.0.1", kv_port, host=PROXY_HOST,
                                                     port=kv_port, zmtp=True)
        # Each worker reaches the first coordinator's Registry (Register, Heartbeat) through a
        # proxy of its own, so one worker's link to the coordinator can be cut; the
        # coordinator's calls to the worker go direct. A raw TCP relay: TLS stays end to end.
        self.registry_links: dict[str, FaultProxy] = {}
        for spec in specs:
            if "--coordinator" not in spec.argv:
                continue
            at = spec.argv.index("--coordinator") + 1
            first, *rest = spec.argv[at].split(",")
            host, port = first.rsplit(":", 1)
            link = FaultProxy(host, int(port), host=PROXY_HOST, port=free_port())
            spec.argv[at] = ",".join([f"{PROXY_HOST}:{link.port}", *rest])
            self.registry_links[spec.name] = link
        self.handle = LocalCluster(specs, self.ready, start_timeout_s=180)

    def __enter__(self) -> ChaosCluster:
        for proxy in (*self.proxies.values(), *self.registry_links.values()):
            proxy.start()
        self.handle.start()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.stop()
        for proxy in (*self.proxies.values(), *self.registry_links.values()):
            proxy.stop()

    # -- processes ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        return [c.spec.name for c in self.handle.children]

    def worker_names(self) -> list[str]:
        return self.names()[len(self.urls):]  # the coordinators come first

    def process(self, name: str):
        return next(c.process for c in self.handle.children if c.spec.name == name)

    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.process.pid for c in self.handle.children if c.process.poll() is None}

    def registrations(self, name: str) -> int:
        """Times the worker logged a registration (its log spans its restarts)."""
        spec = next(c.spec for c in self.handle.children if c.spec.name == name)
        try:
            return spec.log_path.read_text(errors="replace").count("registered with")
        except OSError:
            return 0

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        if sig == signal.SIGKILL:  # recovered once these register again (wait_live)
            for worker in (self.worker_names() if name.startswith("coordinator") else [name]):
                self._awaiting.setdefault(worker, self.registrations(worker))
        process = self.process(name)
        process.send_signal(sig)
        if sig == signal.SIGKILL:
            process.wait(10)

    def cut_registry_link(self, name: str, down: bool) -> None:
        """Cut (or restore) worker `name`'s link to the coordinator's Registry."""
        self.registry_links[name].set(down=down)

    def clear_faults(self) -> None:
        for proxy in (*self.proxies.values(), *self.registry_links.values()):
            proxy.clear()

    def restart_dead(self) -> list[str]:
        """Start again every process that exited (as `tandem serve`'s supervisor would)."""
        dead = [name for name in self.names() if self.process(name).poll() is not None]
        for name in dead:
            self.handle.respawn(name)
        return dead

    # -- the coordinator's view --------------------------------------------------------------

    def workers(self, url: str | None = None) -> list[dict]:
        """What the first coordinator (or the one at `url`) knows of the workers."""
        return get_internal(url or self.url, self.ready.secret, timeout=5)["workers"]

    def metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            m = re.search(rf"^{re.escape(name)} (\S+)$", r.read().decode(), re.M)
        return float(m.group(1)) if m else None

    def all_live(self) -> bool:
        """Every worker is live at every coordinator, and each one killed (or cut off by a
        killed coordinator) has registered again since."""
        if any(self.registrations(w) <= n for w, n in self._awaiting.items()):
            return False
        for url in self.urls:
            try:
                live = {w["worker_id"] for w in self.workers(url) if w["alive"]}
            except OSError:
                return False
            if not live >= set(self.worker_names()):
                return False
        self._awaiting.clear()
        return True

    def wait_live(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.all_live():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def leaked_blocks(self, timeout_s: float) -> dict[str, int | None]:
        """Blocks in use on every worker once it should be idle: waits up to timeout_s for all
        pools to be full again (heartbeats carry the counts), then reports what is not. None
        for a process that could not be asked: the coordinator unreachable (or answering
        nonsense), a worker it lists as not live, whose pool nobody can read. The leak check
        (reliability/chaos.py account_leaks) fails on a None: an unknown count is no 0."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                used = {w["worker_id"]: (w["num_blocks"] - w["num_free_blocks"]) if w["alive"] else None
                        for w in self.workers()}
            except (OSError, ValueError, KeyError, TypeError):
                used = {"coordinator": None}
            if (used and all(n == 0 for n in used.values())) or time.monotonic() > deadline:
                return used
            time.sleep(0.2)

    def stream(self, content: str, num_predict: int, url: str | None = None, **kw) -> Stream:
        """A streaming request to the first coordinator, or to the one at `url`."""
        s = Stream(url or self.url, content, num_predict, **kw)
        s.start()
        return s
