"""The channel between a coordinator and the launcher that supervises its workers (`tandem
serve`, deploy/model_supervisor.py): the coordinator asks it to start a model's workers and to
stop them (models loaded on request, coordinator/on_demand.py).

The launcher makes a socket pair and hands one end to the coordinator it starts, its number in
$TANDEM_SUPERVISOR_FD (as the lifeline's: common/lifeline.py). Nothing else holds either end, so
the channel needs no secret and no port, and it closes when either process dies. Messages are
JSON objects, one per line; each request carries an `id` its reply repeats, so several may be in
flight (a stop does not hold up a start's reply):

    {"id": 1, "op": "start", "model": "qwen3:0.6b", "path": "/…/blobs/sha256-…"}
        -> {"id": 1, "workers": ["qwen3-0-6b-prefill-0", "qwen3-0-6b-decode-0"]}
    {"id": 2, "op": "status", "model": "qwen3:0.6b"}
        -> {"id": 2, "exits": [{"worker": "…", "code": 1, "log_tail": "…"}]}
    {"id": 3, "op": "stop", "model": "qwen3:0.6b"}
        -> {"id": 3, "stopped": ["qwen3-0-6b-decode-0 (pid 4242, exit 0)"], "freed": ["…"]}
    any  -> {"id": n, "error": "why"}

`status` lists the exits of the model's workers since it was started (a worker that dies while
its model loads fails the load at once rather than after the start timeout).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ENV_FD = "TANDEM_SUPERVISOR_FD"
OPS = ("start", "status", "stop")
MAX_LINE = 1 << 20  # a reply holds log tails; nothing legitimate comes near this


class SupervisorError(Exception):
    """The launcher refused or failed a request (its reason), or the channel is gone."""


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    model: str
    path: str = ""  # start only: the resolved file or directory the workers load

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {self.op!r}")
        if not self.model:
            raise ValueError("a request names its model")


@dataclass(frozen=True)
class WorkerExit:
    worker: str
    code: int
    log_tail: str


def encode(message: dict | Request) -> bytes:
    return json.dumps(asdict(message) if isinstance(message, Request) else message).encode() + b"\n"


def decode_request(line: bytes) -> Request:
    data = json.loads(line)
    return Request(int(data["id"]), str(data["op"]), str(data["model"]), str(data.get("path", "")))


def exits_from(reply: dict) -> list[WorkerExit]:
    return [WorkerExit(str(e["worker"]), int(e["code"]), str(e["log_tail"]))
            for e in reply.get("exits", ())]
