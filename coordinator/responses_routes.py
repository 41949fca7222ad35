"""POST /v1/responses (coordinator/responses_api.py has the shapes): the input rendered as a
chat by the model's template (OllamaRoutes.chat_prompt, tools included, refused with Ollama's
400 when the template has none), admitted and cancelled like any request, answered whole or as
the Responses API's event stream, its tool calls parsed into function_call items."""

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
from coordinator.tool_calls import ToolCallParser, call_format


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
        prompt_ids = await self.ollama.chat_prompt(model, req.model, req.messages, req.tools,
                                                   req.params, timings)
        generation = await self.coordinator.submit(prompt_ids, req.params, timings,
                                                   cache_salt=request_salt(request), model=model)
        rid, item_id = ra.new_ids()
        created = ra.now()
        # Tools (coordinator/tool_calls.py): calls are parsed out of the answer, as on
        # /v1/chat/completions; a forced tool_choice makes the whole answer the call.
        calls = (ToolCallParser(call_format(model.tokenizer.chat_template), req.tools or [],
                                req.tool_choice)
                 if req.tools or req.tool_choice.forced else None)
        if req.stream:
            return WatchedStream(_events(rid, item_id, created, req, generation, calls),
                                 generation.close, media_type=SSE)
        text = await collect(request, generation)
        if text is None:
            return Response(status_code=499)
        content, found = calls.split(text) if calls is not None else (text, [])
        output = [ra.message_item(item_id, content, True)] if content or not found else []
        output += [ra.function_call_item(ra.new_item_id("fc"), c) for c in found]
        return JSONResponse(ra.response(rid, req, created, ra.status_of(generation.done_reason),
                                        output, _usage(generation)))


class _Items:
    """A streamed response's output items, in order: text goes to an open message item
    (opened at its first text), a call closes it and is sent whole as its own item."""

    def __init__(self, events: ra.EventStream, first_item_id: str) -> None:
        self.events = events
        self.output: list[dict] = []  # the items done
        self.next_id = first_item_id
        self.text: str | None = None  # the open message's text; None: none open
        self.item_id = ""

    def _place(self) -> dict:
        return {"item_id": self.item_id, "output_index": len(self.output), "content_index": 0}

    def text_delta(self, piece: str) -> list[bytes]:
        out = []
        if self.text is None:
            self.item_id, self.next_id, self.text = self.next_id or ra.new_item_id(), "", ""
            out += [self.events.event("response.output_item.added", output_index=len(self.output),
                                      item=ra.message_item(self.item_id, None, False)),
                    self.events.event("response.content_part.added", **self._place(),
                                      part=ra.output_text(""))]
        if piece:
            self.text += piece
            out.append(self.events.event("response.output_text.delta", **self._place(),
                                         delta=piece, logprobs=[]))
        return out

    def close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        place, text = self._place(), self.text
        item = ra.message_item(self.item_id, text, True)
        out = [self.events.event("response.output_text.done", **place, text=text, logprobs=[]),
               self.events.event("response.content_part.done", **place,
                                 part=ra.output_text(text)),
               self.events.event("response.output_item.done", output_index=len(self.output),
                                 item=item)]
        self.output.append(item)
        self.text = None
        return out

    def call(self, call) -> list[bytes]:
        out = self.close_message()
        item = ra.function_call_item(ra.new_item_id("fc"), call)
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        out += [self.events.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                self.events.event("response.function_call_arguments.delta", **where,
                                  delta=item["arguments"]),
                self.events.event("response.function_call_arguments.done", **where,
                                  arguments=item["arguments"]),
                self.events.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return out

    def take(self, content: str, found: list) -> list[bytes]:
        out = self.text_delta(content) if content else []
        for call in found:
            out += self.call(call)
        return out


async def _events(rid: str, item_id: str, created: int, req: ra.ResponsesRequest,
                  g: Generation, calls: ToolCallParser | None) -> AsyncIterator[bytes]:
    events = ra.EventStream()
    started = ra.response(rid, req, created, "in_progress", [], None)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    items = _Items(events, item_id)
    if calls is None:  # plain text: the message item opens at once, as before any token
        for event in items.text_delta(""):
            yield event
    try:
        async for piece in g.pieces():
            for event in items.take(*(calls.push(piece) if calls is not None else (piece, []))):
                yield event
    except WorkerError as exc:
        yield events.event("error", code="server_error", message=str(exc), param=None)
        return
    if calls is not None:
        for event in items.take(*calls.finish()):
            yield event
    if not items.output and items.text is None:  # nothing at all: an empty message
        for event in items.text_delta(""):
            yield event
    for event in items.close_message():
        yield event
    status = ra.status_of(g.done_reason)
    yield events.event(f"response.{status}",
                       response=ra.response(rid, req, created, status, items.output, _usage(g)))
