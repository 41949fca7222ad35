"""POST /v1/responses (coordinator/responses_api.py has the shapes): the input rendered as a
chat by the model's template (OllamaRoutes.chat_prompt), admitted and cancelled like any
request, answered whole or as the Responses API's event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from coordinator import responses_api as ra
from coordinator.access import request_salt
from coordinator.generation import Generation
from coordinator.http_stream import SSE, WatchedStream, collect, read_json_body
from coordinator.metrics import RequestTimings
from coordinator.ollama_routes import OllamaRoutes
from coordinator.request_flow import WorkerError
from coordinator.service import Coordinator


def _usage(g: Generation) -> dict:
    return ra.usage(g.timings.prompt_tokens, g.timings.output_tokens, g.outcome.cached_tokens)


class ResponsesRoutes:
    def __init__(self, coordinator: Coordinator, ollama: OllamaRoutes) -> None:
        self.coordinator = coordinator
        self.ollama = ollama
        self.limits = coordinator.config

    async def create(self, request: Request) -> Response:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        req = ra.parse_responses(body, self.limits.max_messages, await self.ollama.defaults(body))
        model = await self.coordinator.find_model(req.model, timings)
        prompt_ids = await self.ollama.chat_prompt(model, req.model, req.messages, None,
                                                   req.params, timings)
        generation = await self.coordinator.submit(prompt_ids, req.params, timings,
                                                   cache_salt=request_salt(request), model=model)
        rid, item_id = ra.new_ids()
        created = ra.now()
        if req.stream:
            return WatchedStream(_events(rid, item_id, created, req, generation),
                                 generation.close, media_type=SSE)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        return JSONResponse(ra.response(rid, req, created, ra.status_of(generation.done_reason),
                                        [ra.message_item(item_id, text, True)],
                                        _usage(generation)))


async def _events(rid: str, item_id: str, created: int, req: ra.ResponsesRequest,
                  g: Generation) -> AsyncIterator[bytes]:
    events = ra.EventStream()
    started = ra.response(rid, req, created, "in_progress", [], None)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    yield events.event("response.output_item.added", output_index=0,
                       item=ra.message_item(item_id, None, False))
    place = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield events.event("response.content_part.added", **place, part=ra.output_text(""))
    text = ""
    try:
        async for piece in g.pieces():
            text += piece
            yield events.event("response.output_text.delta", **place, delta=piece, logprobs=[])
    except WorkerError as exc:
        yield events.event("error", code="server_error", message=str(exc), param=None)
        return
    yield events.event("response.output_text.done", **place, text=text, logprobs=[])
    yield events.event("response.content_part.done", **place, part=ra.output_text(text))
    item = ra.message_item(item_id, text, True)
    yield events.event("response.output_item.done", output_index=0, item=item)
    status = ra.status_of(g.done_reason)
    yield events.event(f"response.{status}",
                       response=ra.response(rid, req, created, status, [item], _usage(g)))

