"""Every HTTP request's id and its access log line: the outermost ASGI middleware.

    request ─> RequestLog ─> CORS ─> AccessGuard ─> routes
               ├─ X-Request-Id: the client's when valid, else a new one (common/request_id.py);
               │  set as the request's context, so every log line written while serving it,
               │  and the workers' calls (Coordinator.prepare), carry it
               ├─ the response's head gets `X-Request-Id` (401s, 404s and 500s included)
               └─ once the response ended: one INFO line on logger `coordinator.access`

    127.0.0.1:51234 - "POST /api/chat HTTP/1.1" 200 412.3 ms [request_id=R]

The request's trace span (common/tracing.py) is opened here too, around the app, or, where
FastAPI opened one already, given the request id.

Like uvicorn's access log, but with the duration to the last byte (a stream's whole length)
and the request id; the path only, never the query string or the body (prompts stay out of
logs). A client that left before the head was sent is logged with status 499, as nginx does.
"""

from __future__ import annotations

import logging
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common import request_id, tracing

log = logging.getLogger("coordinator.access")

CLIENT_GONE = 499  # no response head was sent (the client left, or the app failed before it)


class RequestLog:
    def __init__(self, app: ASGIApp, access_log: bool = True) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id.accept(Headers(scope=scope).get(request_id.HEADER))
        status = CLIENT_GONE
        start = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[request_id.HEADER] = rid
            await send(message)

        # The request's trace starts here (common/tracing.py; a no-op when traces are off).
        with request_id.serving(rid), tracing.server_span(
                f"{scope['method']} {scope['path']}", attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                            "tandem.request_id": rid}) as span:
            try:
                await self.app(scope, receive, send_with_id)
            except BaseException:
                status = 500 if status == CLIENT_GONE else status
                raise
            finally:
                if span.is_recording():  # FastAPI's own span ends with the response
                    span.set_attribute("http.response.status_code", status)
                if self.access_log:
                    client = scope.get("client")
                    where = f"{client[0]}:{client[1]}" if client else "-"
                    log.info('%s - "%s %s HTTP/%s" %d %.1f ms', where, scope["method"],
                             scope["path"], scope.get("http_version", "1.1"), status,
                             (time.monotonic() - start) * 1000)


def install_request_log(app, access_log: bool) -> None:
    """Outermost (Starlette runs the middleware added last first): call it after every other
    add_middleware, so that refusals by the access checks get an id and a line too."""
    app.add_middleware(RequestLog, access_log=access_log)
