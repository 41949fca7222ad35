"""The `X-Tandem-Cache` header (coordinator/response_cache.py): hit | miss | bypass on every
HTTP answer that generated text while the response cache is on, for streams too (the header
goes out with the response's head, once every choice of the request has been submitted).

An ASGI middleware: it gives each request a list that `ResponseCache` appends each
Generation's outcome to (response_cache.marks), and writes the header from it.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.response_cache import HEADER, header_value, marks


class CacheHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        outcomes: list[str] = []

        async def send_marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = header_value(outcomes)
                if value is not None:
                    MutableHeaders(scope=message)[HEADER] = value
            await send(message)

        token = marks.set(outcomes)
        try:
            await self.app(scope, receive, send_marked)
        finally:
            marks.reset(token)


def install_cache_header(app) -> None:
    app.add_middleware(CacheHeader)
