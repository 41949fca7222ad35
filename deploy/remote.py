"""The CLI's view of a running tandem server: its Ollama HTTP API, over httpx.

`tandem run`, `list`, `ps` and `show` talk to the server when one answers at the host
(`--host`, else $OLLAMA_HOST, else 127.0.0.1:11434, as ollama's CLI does); `run` falls back to
an in-process engine when none does. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from engine.errors import ModelNotFoundError, TandemError

DEFAULT_HOST = "127.0.0.1:11434"


def base_url(host: str | None) -> str:
    host = (host or DEFAULT_HOST).strip().rstrip("/")
    if "://" not in host:
        host = "http://" + host
    scheme, rest = host.split("://", 1)
    if ":" not in rest.split("/", 1)[0]:
        rest = rest.replace("/", ":11434/", 1) if "/" in rest else rest + ":11434"
    return f"{scheme}://{rest}"


class ServerError(TandemError):
    """The server answered with an error (its message, one line)."""


class Server:
    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s, connect=2.0))

    def running(self) -> bool:
        try:
            return self.client.get("/", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code == 404:
            raise ModelNotFoundError(_error(r))
        if r.status_code >= 400:
            raise ServerError(_error(r))
        return r.json()

    def tags(self) -> list[dict]:
        return self._check(self.client.get("/api/tags"))["models"]

    def ps(self) -> list[dict]:
        return self._check(self.client.get("/api/ps"))["models"]

    def show(self, model: str) -> dict:
        return self._check(self.client.post("/api/show", json={"model": model}))

    def chat(self, model: str, messages: list[dict], options: dict) -> Iterator[dict]:
        """Streamed chat: yields each NDJSON object; raises ServerError on an error line."""
        body = {"model": model, "messages": messages, "options": options, "stream": True}
        with self.client.stream("POST", "/api/chat", json=body) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line:
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise ServerError(obj["error"])
                yield obj


def _error(r: httpx.Response) -> str:
    try:
        error = r.json().get("error")
    except ValueError:
        error = None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error or f"HTTP {r.status_code} from the server")
