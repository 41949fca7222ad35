"""Ollama's blob routes over the model store's blobs (common/blob_store.py): how a client
uploads a GGUF before /api/create names it in `files` (Open WebUI's model upload, the ollama
clients' `create_blob`).

    HEAD /api/blobs/sha256:<hex>    200 if the store holds that blob, 404 otherwise
    POST /api/blobs/sha256:<hex>    the raw body, streamed to disk and sha256-verified:
                                    201 once kept, 200 if it was already there (the body is
                                    not read), 400 for a malformed digest or a body that hashes
                                    to another (nothing kept), 413 past --max-blob-bytes
                                    (before reading, when Content-Length says so), 507 when
                                    the disk is full

The body never sits in memory: it is written in pieces of at most CHUNK bytes, each on a
thread (hashing and disk writes stay off the event loop). The JSON body limit
(--max-body-bytes) is not this route's; the API key is, as for every route (access.py).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from common.blob_store import BlobSpaceError, BlobStore, BlobTooLargeError, BlobUpload
from coordinator.model_routes import ModelRoutes
from coordinator.ollama_request import RequestError

CHUNK = 1 << 20


class BlobRoutes:
    def __init__(self, models: ModelRoutes) -> None:
        self.models = models

    def blobs(self) -> BlobStore:
        return self.models.store().blob_store(self.models.limits.max_blob_bytes)

    async def head(self, digest: str) -> Response:
        found = await asyncio.to_thread(self.blobs().has, digest)
        return Response(status_code=200 if found else 404)

    async def push(self, digest: str, request: Request) -> Response:
        blobs = self.blobs()
        if await asyncio.to_thread(blobs.has, digest):
            return Response(status_code=200)
        length = request.headers.get("content-length")
        announced = int(length) if length is not None and length.isdigit() else None
        try:
            upload = await asyncio.to_thread(blobs.receive, digest, announced)
        except BlobTooLargeError as exc:
            raise RequestError(str(exc), 413) from None
        except BlobSpaceError as exc:
            raise RequestError(str(exc), 507) from None
        try:
            await _receive(request, upload)
        finally:
            upload.abort()  # a no-op once committed; otherwise nothing of the upload stays
        return Response(status_code=201)


async def _receive(request: Request, upload: BlobUpload) -> None:
    pending, size = [], 0
    try:
        async for piece in request.stream():
            pending.append(piece)
            size += len(piece)
            if size >= CHUNK:
                await asyncio.to_thread(upload.write, b"".join(pending))
                pending, size = [], 0
        if pending:
            await asyncio.to_thread(upload.write, b"".join(pending))
        await asyncio.to_thread(upload.commit)
    except BlobTooLargeError as exc:
        raise RequestError(str(exc), 413) from None
    except BlobSpaceError as exc:
        raise RequestError(str(exc), 507) from None
