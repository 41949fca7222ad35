"""Embeddings on a worker's engine (engine/embedding.py), for either worker: each input is a
pooling request that the engine schedules like a prompt. A worker *has* an Embedder, wired to
its engine loop:

    embed()    asyncio side: validates, queues one pooling request per input on the engine
               thread, awaits the vectors; cancelled (the client left) -> the inputs still
               running are aborted there and their blocks freed
    take()     engine thread, from the worker's on_outputs: the outputs that end embedding
               requests are handed to their callers; the rest go back to the worker
    fail_all() asyncio side, when the engine loop died

Invariant: an embedding request id is in `_in_engine` (engine thread) from its submit until its
output or its abort, and its caller's future in `_callers` (asyncio thread) until embed()
returns; no output reaches a caller that has gone.
"""

from __future__ import annotations

import asyncio
import itertools

from common.errors import TandemError
from common.pooling import Pooling
from engine.step_output import StepOutput
from worker.engine_loop import EngineLoop, settle


class Embedder:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self._callers: dict[str, asyncio.Future] = {}  # asyncio thread
        self._in_engine: set[str] = set()  # engine thread
        self._batches = itertools.count()

    async def embed(self, inputs: list[list[int]], normalize: bool = True,
                    max_chunk_tokens: int = 0,
                    pooling: Pooling = Pooling.MEAN) -> list[list[float]]:
        """Pooled embeddings of `inputs`, chunked under the engine's token budget (at most
        `max_chunk_tokens` of one input per pass: the coordinator's chunk plan; 0 = the
        budget). ValueError for an empty or too long input."""
        loop, engine = self.loop, self.loop.engine
        loop.check_alive()
        engine.require_resident()
        limit = engine.context_length
        for ids in inputs:
            if not ids or len(ids) > limit:
                raise ValueError(f"an input has {len(ids)} tokens; each needs 1 to {limit}")
        batch = next(self._batches)
        futures = {f"embed-{batch}-{i}": loop.loop.create_future() for i in range(len(inputs))}
        self._callers.update(futures)
        jobs = list(zip(futures, inputs))
        loop.call(lambda: self._admit(jobs, normalize, max_chunk_tokens, pooling))
        try:
            return list(await asyncio.gather(*futures.values()))
        finally:
            for request_id in futures:
                self._callers.pop(request_id, None)
            pending = [rid for rid, f in futures.items() if not f.done() or f.cancelled()]
            if pending:
                loop.call(lambda: [self._abort(rid) for rid in pending])

    def take(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Engine thread: resolve the outputs that end embedding requests; the others back."""
        rest = []
        for out in outputs:
            if out.request_id not in self._in_engine:
                rest.append(out)
                continue
            self._in_engine.discard(out.request_id)
            error = None if out.embedding is not None else RuntimeError(
                out.error or f"embedding ended {out.status.value}")
            self.loop.post(self._resolve, out.request_id, out.embedding, error)
        return rest

    def fail_all(self, exc: BaseException) -> None:
        """Asyncio side: the engine loop died."""
        for future in list(self._callers.values()):
            settle(future, None, RuntimeError(f"engine failed: {exc}"))

    # -- engine thread -------------------------------------------------------------------

    def _admit(self, jobs: list[tuple[str, list[int]]], normalize: bool,
               max_chunk_tokens: int, pooling: Pooling) -> None:
        engine = self.loop.engine
        for request_id, ids in jobs:
            try:
                engine.require_resident()
                request = engine.make_embedding_request(ids, normalize, request_id, pooling)
                request.max_chunk_tokens = max(0, max_chunk_tokens)
                engine.submit(request)
            except (TandemError, ValueError) as exc:
                self.loop.post(self._resolve, request_id, None, exc)
                continue
            self._in_engine.add(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self._in_engine:
            self._in_engine.discard(request_id)
            self.loop.engine.abort_request(request_id)

    # -- asyncio side --------------------------------------------------------------------

    def _resolve(self, request_id: str, vector: list[float] | None,
                 exc: BaseException | None) -> None:
        future = self._callers.get(request_id)
        if future is not None:
            settle(future, vector, exc)
