"""One request never stalls another: an innocent stream's inter-token gaps while a hostile
request is in flight, against a real cluster (1 prefill + 1 decode worker, as `tandem serve`).

    python -m benchmarks.bench_isolation [--model smollm2] [--embed-tokens 3000]
                                         [--schema-props 1000] [--stops 256] [--rounds 2]

Attacks (issue 26), each run while the innocent stream (a chat of --stream-tokens tokens) is
past its first token:
  none              the stream alone (the baseline gap)
  embed             /api/embed of one --embed-tokens-token input (chunked like a prompt)
  embed-leave       the same, its client gone after 1 s (the work stops)
  schema            a `format` JSON schema of --schema-props string properties (compiled on
                    the workers' grammar threads, off the engine thread)
  schema-oversized  10,000 properties (289 KB): refused before any work
  stops             4 requests with --stops stop strings each, streaming (the matcher's cost
                    per token does not grow with their number)
  stops-oversized   110,000 stop strings: refused before any work
Printed per attack: the attack's HTTP status, its duration, and the innocent stream's
largest and median inter-token gap (ms), next to the baseline's. The figures say what this
host does; the test (tests/coordinator/test_isolation_attacks.py) asserts only what does not
depend on its speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

WORDS = ("the of and to in is was for on that with as by it at from his an were are which this "
         "be or has had not but what all when can there been one its who new more about").split()


@dataclass
class Outcome:
    attack: str
    status: int  # the hostile request's HTTP status (0: none sent; -1: the client left)
    seconds: float  # how long the hostile request took (until its answer or its client left)
    gaps: list[float] = field(default_factory=list)  # the innocent stream's inter-token gaps
    tokens_during: int = 0  # innocent tokens that arrived while the hostile request was open
    detail: str = ""

    @property
    def max_gap_ms(self) -> float:
        return 1e3 * max(self.gaps, default=0.0)

    @property
    def p50_gap_ms(self) -> float:
        return 1e3 * statistics.median(self.gaps) if self.gaps else 0.0


def _post(url: str, path: str, body: dict, timeout: float = 600) -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def text(tokens: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens))


def schema(props: int) -> dict:
    names = [f"field_{i}" for i in range(props)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names},
            "required": names[:1]}


def hostile_requests(attack: str, model: str, args) -> list[tuple[str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "stream": False,
            "options": {"temperature": 0, "num_predict": 8}}
    if attack in ("embed", "embed-leave"):
        return [("/api/embed", {"model": model, "input": text(args.embed_tokens)})]
    if attack == "schema":
        return [("/api/chat", {**chat, "format": schema(args.schema_props)})]
    if attack == "schema-oversized":
        return [("/api/chat", {**chat, "format": schema(10_000)})]
    if attack == "stops":
        stops = [f"never-{i:06d}-stop" for i in range(args.stops)]
        return [("/api/chat", {**chat, "stream": True,
                               "options": {**chat["options"], "num_predict": 40, "stop": stops}})] * 4
    if attack == "stops-oversized":
        stops = [f"never-{i:06d}-stop" for i in range(110_000)]
        return [("/api/chat", {**chat, "options": {**chat["options"], "stop": stops}})]
    return []


def _send(url: str, path: str, body: dict, leave_after_s: float | None) -> tuple[int, float]:
    start = time.monotonic()
    if leave_after_s is None:
        status, _ = _post(url, path, body)
        return status, time.monotonic() - start
    try:  # a client that gives up: the socket closes when its timeout fires
        _post(url, path, body, timeout=leave_after_s)
    except (TimeoutError, urllib.error.URLError, OSError):
        pass
    return -1, time.monotonic() - start


def run_attack(url: str, model: str, attack: str, args) -> Outcome:
    """The innocent stream, with `attack` sent once its first token is out."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Tell a story."}],
                       "options": {"temperature": 0, "num_predict": args.stream_tokens,
                                   "stop": []}}).encode()
    request = urllib.request.Request(url + "/api/chat", data=body,
                                     headers={"Content-Type": "application/json"})
    outcome = Outcome(attack, 0, 0.0)
    hostile = hostile_requests(attack, model, args)
    open_window: list[float] = []  # [start, end] of the hostile requests
    threads: list[threading.Thread] = []
    results: list[tuple[int, float]] = []

    def fire() -> None:
        open_window.append(time.monotonic())
        for path, hostile_body in hostile:
            t = threading.Thread(target=lambda p=path, b=hostile_body: results.append(
                _send(url, p, b, 1.0 if attack == "embed-leave" else None)))
            t.start()
            threads.append(t)

    times: list[float] = []
    with urllib.request.urlopen(request, timeout=600) as r:
        for line in r:
            chunk = json.loads(line)
            if "error" in chunk:
                outcome.detail = chunk["error"]
                break
            if not chunk.get("done") and chunk["message"]["content"]:
                times.append(time.monotonic())
                if len(times) == 3 and hostile:
                    fire()
    for t in threads:
        t.join()
    if open_window:
        end = open_window[0] + max(s for _, s in results)
        outcome.tokens_during = sum(open_window[0] < t <= end for t in times)
        outcome.status = results[0][0] if len({s for s, _ in results}) == 1 else -2
        outcome.seconds = max(s for _, s in results)
    gaps = [b - a for a, b in zip(times, times[1:])]
    outcome.gaps = gaps[2:] if hostile else gaps  # from the attack's start on
    return outcome


def main(argv: list[str] | None = None) -> None:
    import tempfile
    from pathlib import Path

    from common.model_store import default_store
    from deploy.local import LocalCluster
    from deploy.process_plan import free_port, plan
    from deploy.local_topology import Topology

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--embed-tokens", type=int, default=3000)
    p.add_argument("--schema-props", type=int, default=1000)
    p.add_argument("--stops", type=int, default=256)
    p.add_argument("--stream-tokens", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    path = default_store().resolve(args.model)
    attacks = ["none", "embed", "embed-leave", "schema", "schema-oversized", "stops",
               "stops-oversized"]
    with tempfile.TemporaryDirectory(prefix="tandem-isolation-") as tmp:
        topology = Topology(model=str(path), model_path=path, log_dir=Path(tmp), port=free_port(),
                            coordinator_args=("--model-name", "m"))
        specs, ready = plan(topology)
        with LocalCluster(specs, ready, start_timeout_s=300) as cluster:
            cluster.start()
            run_attack(ready.url, "m", "none", args)  # warm-up
            print(f"{'attack':18} {'status':>6} {'seconds':>8} {'max gap ms':>11} "
                  f"{'p50 gap ms':>11} {'tokens during':>14}")
            for _ in range(args.rounds):
                for attack in attacks:
                    o = run_attack(ready.url, "m", attack, args)
                    print(f"{o.attack:18} {o.status:>6} {o.seconds:>8.2f} {o.max_gap_ms:>11.1f} "
                          f"{o.p50_gap_ms:>11.1f} {o.tokens_during:>14} {o.detail}", flush=True)


if __name__ == "__main__":
    main()
