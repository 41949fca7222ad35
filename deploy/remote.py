"""The CLI's view of a running tandem server: its Ollama HTTP API, over httpx.

`tandem run`, `list`, `ps` and `show` talk to the server when one answers at the host
(`--host`, else $OLLAMA_HOST, else 127.0.0.1:11434, as ollama's CLI does); `run` falls back to
an in-process engine when none does. A server started with an API key gets it as
`Authorization: Bearer KEY` (the CLI passes $TANDEM_API_KEY). Torch-free.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from common.errors import ModelNotFoundError, TandemError

DEFAULT_HOST = "127.0.0.1:11434"
DEFAULT_PORT = 11434


@dataclass(frozen=True)
class HostAddress:
    """OLLAMA_HOST (or --host) split as Ollama's envconfig.Host splits it."""

    scheme: str  # "http" unless the value named one
    host: str  # "" when the value left it out (":11434")
    port: int
    path: str = ""  # a path prefix ("/ollama" behind a proxy), no trailing slash


def parse_host(value: str | None) -> HostAddress:
    """`host`, `host:port`, `[v6]:port`, `scheme://host[:port][/path]`; quotes and spaces
    around it are dropped. The port defaults to 11434, or to 80 / 443 after an explicit
    http:// / https:// (Ollama's rule); a port that is not a number in 0..65535 is an error
    here (Ollama logs it and takes the default)."""
    text = (value or "").strip().strip("\"'").strip()
    scheme, sep, rest = text.partition("://")
    default_port = DEFAULT_PORT
    if not sep:
        scheme, rest = "http", text
    elif scheme in ("http", "https"):
        default_port = 80 if scheme == "http" else 443
    hostport, _, path = rest.partition("/")
    host, port = hostport, ""
    if hostport.startswith("["):  # [v6] or [v6]:port
        inside, _, after = hostport[1:].partition("]")
        host, port = inside, after.removeprefix(":")
    elif hostport.count(":") == 1:  # more than one: a bare IPv6 address, no port
        host, port = hostport.split(":")
    if port and not (port.isdigit() and int(port) <= 65535):
        raise TandemError(f"OLLAMA_HOST / --host {value!r}: the port must be a number "
                          "between 0 and 65535")
    return HostAddress(scheme, host, int(port) if port else default_port,
                       ("/" + path).rstrip("/") if path else "")


def base_url(host: str | None) -> str:
    """The URL a client reaches the server at; an empty host is 127.0.0.1."""
    a = parse_host(host or DEFAULT_HOST)
    name = a.host or "127.0.0.1"
    name = f"[{name}]" if ":" in name else name
    return f"{a.scheme}://{name}:{a.port}{a.path}"


class ServerError(TandemError):
    """The server answered with an error (its message, one line)."""


class Server:
    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None,
                 ca_file: str | None = None) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # An https:// server's certificate is checked against ca_file, else the system's CAs.
        try:
            verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        except (OSError, ssl.SSLError) as exc:
            raise TandemError(f"CA file {ca_file} (--ca-file / TANDEM_CA_FILE) is not usable: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        self.client = httpx.Client(base_url=url, headers=headers, verify=verify,
                                   timeout=httpx.Timeout(timeout_s, connect=2.0))

    def running(self) -> bool:
        try:
            return self.client.get("/", timeout=2.0).status_code == 200
        except httpx.ConnectError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):  # a server, but not one we trust
                raise TandemError(f"{self.url}: the server's certificate is not trusted "
                                  f"({exc}); pass its CA with --ca-file") from None
            return False
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
