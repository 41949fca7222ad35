"""Ollama's model management routes over the coordinator's model store (common/model_store.py).

    POST   /api/pull    {model, stream?}          NDJSON lines: pulling manifest; downloading
                                                  <digest> with total and completed bytes (pip's
                                                  own count of the wheel); verifying sha256
                                                  digest; success. stream false: one object.
    POST   /api/copy    {source, destination}     200, empty body
    POST   /api/create  {model, from | files,     `from`: an absolute path on this host to a
                         template?, system?,      .gguf file or a Hugging Face directory
                         stream?}                 (registered where it lies), or a model name;
                                                  a path that cannot be served is one 400 (below).
                                                  `files`: {"NAME.gguf": "sha256:<hex>"}, one
                                                  GGUF blob uploaded to /api/blobs
                                                  (coordinator/blob_routes.py). NDJSON lines:
                                                  parsing GGUF, using existing layer <digest>,
                                                  writing manifest, success
    DELETE /api/delete  {model}                   200, empty body

`template` (a Jinja chat template, as Hugging Face's; an Ollama Go template is a 400 that says
so) and `system` (the system message of a chat that has none) are kept in the name's manifest
and applied when that name is served (common/chat_template_choice.py, coordinator/prompts.py).
Refused with a 400 naming the field, never dropped: `adapters`, `quantize` (weight formats are
chosen per role when serving: --prefill-quant, --decode-quant), `parameters`, `messages` and
`license` (tandem takes options per request; stored ones would never be applied), and `files`
other than one .gguf blob (a safetensors set: register its directory with `from`).

The served models are fixed when the coordinator starts: the workers loaded them and keep them.
So a pulled or created model is served by `tandem serve --model NAME`; a copy of a served model
answers under its new name at once (one created with another template or system message does
not: the served model keeps its own, and `tandem serve --model NAME` serves the name); a name
whose files the workers hold (a served model's name, or a name that would delete its file) is
not deleted: 409. Store work (pip, hashing, hard
links, reading a GGUF header) runs on threads, never on the event loop.

`from` names a path on the server's host, so what create answers must not tell a client what
lies there: every path that cannot be registered (missing, unreadable, not absolute, `~user`,
not a model) gets the same 400 (UNSERVABLE_SOURCE); the reason goes to the server's log only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from coordinator.http_stream import ClientGone, WatchedStream, read_json_body, until_disconnected
from coordinator.model import shown
from coordinator.ollama_request import RequestError, stream_flag
from coordinator.ollama_response import error_body, ndjson
from coordinator.service import Coordinator
from common.blob_store import BlobDigestError, parse_digest
from common.chat_template import check_template
from common.errors import ChatTemplateError, ModelNameError, ModelNotFoundError, TandemError
from common.model_store import (
    ModelStore, Overrides, PullProgress, PullStatus, check_name, normalize_name,
)

log = logging.getLogger(__name__)

UNSUPPORTED_CREATE = {
    "adapters": "adapters (LoRA) are not supported",
    "quantize": "quantize is not supported: tandem chooses weight formats per role when "
                "serving (--prefill-quant, --decode-quant)",
}
UNSUPPORTED_OVERRIDES = ("parameters", "messages", "license")
UNSERVABLE_SOURCE = ("cannot create a model from that path: `from` must be the absolute path "
                     "of a .gguf file or a Hugging Face directory that the server can read and "
                     "serve (the server's log says why it could not)")


class PullCancelled(Exception):
    """Raised on the pulling thread at its next progress report once the client has gone."""


class ModelRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.limits = coordinator.config

    def store(self) -> ModelStore:
        if self.coordinator.store is None:
            raise RequestError("this coordinator was started without a model store", 501)
        return self.coordinator.store

    async def pull(self, request: Request) -> Response:
        body = await read_json_body(request, self.limits.max_body_bytes)
        name, stream, models = _model_field(body), stream_flag(body), self.store()
        if models.entry(name) is None:
            raise ModelNotFoundError(f"model '{shown(name)}' is not one tandem can pull; "
                                     f"known models: {', '.join(models.known_names())}")
        cancel = threading.Event()
        events = _pull_events(models, name, cancel)
        if stream:
            async def on_close() -> None:
                cancel.set()

            return WatchedStream(_pull_lines(events), on_close)
        try:
            await until_disconnected(request, _drain(events))
        except ClientGone:
            cancel.set()
            return Response(status_code=499)
        except TandemError as exc:
            raise RequestError(f"pull of '{shown(name)}' failed: {exc}", 500) from exc
        return JSONResponse({"status": PullStatus.SUCCESS.value})

    async def copy(self, request: Request) -> Response:
        body = await read_json_body(request, self.limits.max_body_bytes)
        source, destination = _str_field(body, "source"), _str_field(body, "destination")
        await _add_name(self.coordinator, self.store(), destination, source)
        return Response(status_code=200)

    async def create(self, request: Request) -> Response:
        body = await read_json_body(request, self.limits.max_body_bytes)
        name, stream = _model_field(body), stream_flag(body)
        _refuse_unsupported(body)
        overrides = _overrides(body)
        source, files = body.get("from"), body.get("files")
        lines: list[dict[str, Any]] = []
        if files:
            if source:
                raise RequestError("send either from or files, not both")
            digest = _one_gguf_blob(files)
            lines += [{"status": "parsing GGUF"}, {"status": f"using existing layer {digest}"}]
            await self._create_from_blob(name, digest, overrides)
        else:
            if not isinstance(source, str) or not source:
                raise RequestError("from or files is required: the absolute path of a .gguf "
                                   "file or a Hugging Face directory on the server's host, a "
                                   "model name, or {\"NAME.gguf\": \"sha256:...\"} of a blob "
                                   "uploaded to /api/blobs")
            await _add_name(self.coordinator, self.store(), name, source, overrides)
        if not stream:
            return JSONResponse({"status": PullStatus.SUCCESS.value})
        lines += [{"status": "writing manifest"}, {"status": PullStatus.SUCCESS.value}]
        return Response(b"".join(ndjson(line) for line in lines),
                        media_type="application/x-ndjson")

    async def _create_from_blob(self, name: str, digest: str, overrides: Overrides) -> None:
        models = self.store()
        check_name(name)
        if self.coordinator.models.find(name) is not None:
            raise _in_use(name)
        blob = models.blob_store(self.limits.max_blob_bytes).path(digest)
        if not blob.is_file():
            raise RequestError(f"blob {digest} not found: upload it first "
                               f"(POST /api/blobs/{digest})")
        try:
            path = await asyncio.to_thread(models.create_from_blob, name, blob, overrides)
        except ModelNameError:
            raise
        except (TandemError, OSError, ValueError) as exc:
            # The client's own bytes: the reason is theirs to see (no host path in it).
            raise RequestError(f"cannot create a model from blob {digest}: "
                               f"{str(exc).replace(str(blob), blob.name)}") from None
        served = next((m for m in self.coordinator.models if _same(path, m.path)), None)
        if served is not None and await _served_alike(models, name, served.name):
            self.coordinator.add_model_name(normalize_name(name), served)

    async def delete(self, request: Request) -> Response:
        body = await read_json_body(request, self.limits.max_body_bytes)
        name, models = _model_field(body), self.store()
        served = list(self.coordinator.models)
        try:
            files = await asyncio.to_thread(models.removes, name)
        except ModelNotFoundError:
            if self.coordinator.models.find(name) is not None:
                raise _in_use(name) from None
            raise
        if any(normalize_name(name) == normalize_name(m.name) or any(
                _holds(m.path, f) for f in files) for m in served):
            raise _in_use(name)
        await asyncio.to_thread(models.delete, name)
        self.coordinator.drop_model_name(name)
        self.coordinator.drop_model_name(normalize_name(name))
        return Response(status_code=200)


async def _add_name(coordinator: Coordinator, models: ModelStore, name: str, source: str,
                    overrides: Overrides | None = None) -> None:
    """/api/copy and /api/create: `name` for the model `source` (a name, or a path to register);
    a served model answers to `name` too when `source` is that model, unless `overrides` give
    the name a template or system message of its own (then only its manifest has them)."""
    if normalize_name(source) == normalize_name(name):
        raise RequestError(f"source and destination are the same model '{shown(name)}'")
    if coordinator.models.find(name) is not None:
        raise _in_use(name)
    served = None if source.startswith(("/", "~", ".")) else coordinator.models.find(source)
    if source.startswith(("/", "~", ".")):
        path = await _create_from_path(models, name, source, overrides or Overrides())
    elif served is not None:
        # The served model may not be in the store at all (served from a path, named by
        # --model-name): copy its path.
        # A copy keeps what create stored with the served name, unless given its own.
        kept = (overrides or Overrides()).over(models.overrides(served.name))
        path = await asyncio.to_thread(models.copy, str(served.path), name, True, kept)
    else:  # a name: never looked up as a path (that would tell what files the host has)
        try:
            path = await asyncio.to_thread(models.copy, source, name, False, overrides)
        except ModelNotFoundError as exc:
            # The store's message names the server's folders: the log's, not the client's.
            log.info("/api/copy or /api/create from %r: %s", shown(source), exc)
            raise ModelNotFoundError(f"model '{shown(source)}' not found") from None
    if served is None:
        served = next((m for m in coordinator.models if _same(path, m.path)), None)
    # The new name answers now only if it would be served as the served model is (what its
    # manifest keeps is what the served name's keeps).
    if served is not None and await _served_alike(models, name, served.name):
        coordinator.add_model_name(normalize_name(name), served)


async def _create_from_path(models: ModelStore, name: str, source: str,
                            overrides: Overrides) -> Path:
    check_name(name)
    try:
        return await asyncio.to_thread(models.create, name, source, overrides)
    except ModelNameError:
        raise  # about the name, the client's own; raised only once the path checked out
    except (TandemError, OSError, ValueError) as exc:
        log.info("/api/create of %r from %s refused: %s", shown(name), shown(source), exc)
        raise RequestError(UNSERVABLE_SOURCE) from None


async def _served_alike(models: ModelStore, name: str, served: str) -> bool:
    return await asyncio.to_thread(lambda: models.overrides(name) == models.overrides(served))


def _in_use(name: str) -> RequestError:
    return RequestError(f"model '{shown(name)}' is being served: this cluster's workers loaded "
                        "it and hold it; stop the server (or serve another model) before "
                        "deleting or replacing it", 409)


def _holds(served: Path, path: Path) -> bool:
    """True if deleting `path` takes a file from under the workers (a hard link of the served
    file elsewhere in the store is another path: deleting it leaves the served one whole)."""
    served, path = served.resolve(), path.resolve()
    return path == served or served in path.parents


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.is_file() and b.is_file() and a.samefile(b))
    except OSError:
        return False


# ---- pull: the store's thread -> NDJSON lines ---------------------------------------------------

async def _pull_events(models: ModelStore, name: str,
                       cancel: threading.Event) -> AsyncIterator[PullProgress]:
    """The pull's progress reports as they happen. The pull runs on a thread; once `cancel` is
    set (the client left), its next report raises PullCancelled there, which kills pip and
    removes partial files (ModelStore.pull)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[PullProgress | None] = asyncio.Queue()

    def report(event: PullProgress) -> None:
        if cancel.is_set():
            raise PullCancelled()
        loop.call_soon_threadsafe(queue.put_nowait, event)

    # Reports queued by the thread run before the task's completion is delivered (both go
    # through call_soon_threadsafe, in order), so the None below comes after the last one.
    task = asyncio.ensure_future(asyncio.to_thread(models.pull, name, report))
    task.add_done_callback(lambda t: (queue.put_nowait(None), t.cancelled() or t.exception()))
    try:
        while (event := await queue.get()) is not None:
            yield event
        task.result()
    finally:
        cancel.set()


async def _drain(events: AsyncIterator[PullProgress]) -> None:
    async for _ in events:
        pass


async def _pull_lines(events: AsyncIterator[PullProgress]) -> AsyncIterator[bytes]:
    """Ollama's status lines: every download report; each other step once."""
    last: PullStatus | None = None
    try:
        async for event in events:
            if event.status is PullStatus.DOWNLOADING:
                yield ndjson({"status": f"downloading {event.digest}", "digest": event.digest,
                              "total": event.total, "completed": event.completed})
            elif event.status is not last:
                yield ndjson({"status": event.status.value})
            last = event.status
    except TandemError as exc:
        yield ndjson(error_body(str(exc)))
    except Exception as exc:  # the status line is sent: the stream's last line says what broke
        log.exception("pull failed")
        yield ndjson(error_body(f"internal error: {type(exc).__name__}: {exc}"))


# ---- request fields (Ollama's: unknown fields are ignored) --------------------------------------

def _model_field(body: dict[str, Any]) -> str:
    """`model`, or the older `name` some clients still send."""
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model.strip():
        raise RequestError("model is required")
    return model.strip()


def _str_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{name} is required")
    return value.strip()


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for field, message in UNSUPPORTED_CREATE.items():
        if body.get(field):
            raise RequestError(message)
    for field in UNSUPPORTED_OVERRIDES:
        if body.get(field):
            raise RequestError(f"{field} is not supported: tandem takes options with each "
                               "request (a stored template and system message are kept)")


def _overrides(body: dict[str, Any]) -> Overrides:
    """create's `template` (checked to parse now, not when the name is served) and `system`."""
    template, system = body.get("template"), body.get("system")
    for field, value in (("template", template), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise RequestError(f"{field} must be a string")
    if template:
        try:
            check_template(template)
        except ChatTemplateError as exc:
            raise RequestError(f"template: {exc}") from None
    return Overrides(template or None, system or None)


def _one_gguf_blob(files: Any) -> str:
    """The digest of `files`' one .gguf entry ({"NAME.gguf": "sha256:<hex>"})."""
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in files.items()):
        raise RequestError('files must be an object of file names and digests: '
                           '{"NAME.gguf": "sha256:<hex>"}')
    if len(files) != 1 or not next(iter(files)).lower().endswith(".gguf"):
        raise RequestError("files must name exactly one .gguf file (a safetensors model: "
                           "register its directory with `from`), got "
                           f"{', '.join(shown(k, 60) for k in list(files)[:4])}")
    digest = next(iter(files.values()))
    try:
        parse_digest(digest)
    except BlobDigestError as exc:
        raise RequestError(f"files: {exc}") from None
    return digest
