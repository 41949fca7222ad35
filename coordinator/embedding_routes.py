"""Embedding routes: Ollama's /api/embed (batched) and legacy /api/embeddings, and OpenAI's
/v1/embeddings (the table is coordinator/routes.py). The coordinator tokenizes (off the event
loop), checks each input against the context, and one decode worker's Embed RPC computes the
vectors (engine/embedding.py: the final normed hidden states, mean-pooled, or the last
position's with tandem's `"pooling": "last"`; L2-normalized except on the legacy route, as
Ollama). `dimensions` shortens each vector and normalizes it again.

Differences from Ollama kept on purpose: an empty input (`""`, `[]`, or an empty string in the
list) is a 400 here, where Ollama answers an empty list (its way to load a model; tandem's
workers hold theirs already). Inputs are tokenized as given, without the chat template, with
the tokenizer's special tokens (BOS where the model has one, and the end-of-text token an
embedding model's vocabulary asks for: GGUF add_eos_token, a tokenizer.json post-processor's
last token), as Ollama and llama.cpp do.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from coordinator.http_stream import read_json_body, until_disconnected
from coordinator.metrics import RequestTimings
from coordinator.model import ServedModel, shown
from coordinator.ollama_request import RequestError
from coordinator.prompts import encode, off_loop
from coordinator.service import Coordinator
from common.errors import ContextLengthError
from common.pooling import Pooling


MAX_EMBED_INPUTS = 512  # inputs in one embedding request (OpenAI takes up to 2,048)
MAX_REPLY_BYTES = 4 << 20  # gRPC's default message limit on the worker -> coordinator channel


def _check_count(items: list, limit: int) -> None:
    if len(items) > limit:
        raise RequestError(f"an embedding request takes at most {limit} inputs for this model, "
                           f"got {len(items)}")


async def _model(body: dict[str, Any], coordinator: Coordinator) -> tuple[str, ServedModel]:
    """The request's model name as given, and the model it names (loaded first when models
    load on request; a 404 if none)."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RequestError("model is required")
    return name, await coordinator.find_model(name)


def _texts(value: Any, field: str, tokens_allowed: bool) -> list[str | list[int]]:
    """`value` as a list of inputs: a string, a list of strings, and (OpenAI) a token array or
    a list of token arrays. Empty inputs are a 400."""
    def is_tokens(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        items: list[Any] = [value]
    elif tokens_allowed and is_tokens(value) and value:
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise RequestError(f"{field} must be a string or a list of strings"
                           + (" or token arrays" if tokens_allowed else ""))
    if not items:
        raise RequestError(f"{field} is empty")
    for item in items:
        if not (isinstance(item, str) or (tokens_allowed and is_tokens(item))):
            raise RequestError(f"each {field} must be a string"
                               + (" or an array of token ids" if tokens_allowed else ""))
        if len(item) == 0:
            raise RequestError(f"{field} holds an empty input")
    return items


def _token_ids(model: ServedModel, items: list[str | list[int]], context: int,
               truncate: bool) -> list[list[int]]:
    """Tokenizing thread: each input's ids, cut to `context` tokens with `truncate`, else a
    ContextLengthError for one that is longer."""
    vocab = model.config.vocab_size
    out = []
    for item in items:
        if isinstance(item, str):
            ids = encode(model.tokenizer, item, add_special_tokens=True,
                         context=None if truncate else context, embedding=True)
        else:
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            ids = list(item)
        if not ids:
            raise RequestError("an input has no tokens")
        if len(ids) > context:
            if not truncate:
                raise ContextLengthError(f"the input is {len(ids)} tokens, more than the model's "
                                         f"{context}-token context length")
            end = getattr(model.tokenizer, "end_token_id", None)
            # A last-pooled embedder reads its vector at the end token: the text is cut, not it.
            ids = (ids[:context - 1] + [end] if isinstance(item, str) and end is not None
                   else ids[:context])
        out.append(ids)
    return out


def _context(body: dict[str, Any], model: ServedModel) -> int:
    options = body.get("options")
    if options is None:
        return model.context_len
    if not isinstance(options, dict):
        raise RequestError("options must be an object")
    num_ctx = options.get("num_ctx")
    if num_ctx is None:
        return model.context_len
    if not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx <= 0:
        raise RequestError("option 'num_ctx' must be a positive integer")
    return min(num_ctx, model.context_len)


def _truncate(body: dict[str, Any]) -> bool:
    value = body.get("truncate", True)
    if not isinstance(value, bool):
        raise RequestError("truncate must be true or false")
    return value


def _pooling(body: dict[str, Any], model: ServedModel) -> Pooling:
    """`pooling` (tandem's field on every embedding route; common/pooling.py): "mean" or
    "last"; the model's own (ModelConfig.pooling, from its file) when absent."""
    value = body.get("pooling")
    if value is None:
        return model.config.pooling
    try:
        return Pooling.parse(value)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class EmbeddingRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.limits = coordinator.config

    async def _vectors(self, request: Request, model: ServedModel, items: list, context: int,
                       truncate: bool, normalize: bool, timings: RequestTimings,
                       pooling: Pooling = Pooling.MEAN) -> tuple[list[list[float]], int]:
        """The inputs' vectors, computed by a worker of `model`; ClientGone (the work
        cancelled on every worker) when the client leaves first."""
        _check_count(items, _max_inputs(model))
        ids = await off_loop(_token_ids, model, items, context, truncate)
        count = sum(map(len, ids))
        timings.prompt_tokens = count
        vectors = await until_disconnected(
            request, self.coordinator.embed(ids, normalize, timings, model, pooling))
        return vectors, count

    async def embed(self, request: Request) -> JSONResponse:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        name, model = await _model(body, self.coordinator)
        items = _texts(body.get("input"), "input", tokens_allowed=False)
        dims = _dimensions(body, model.config.hidden_size)
        embeddings, count = await self._vectors(request, model, items, _context(body, model),
                                                _truncate(body), True, timings, _pooling(body, model))
        embeddings = shorten(embeddings, dims)
        return JSONResponse({"model": name, "embeddings": embeddings,
                             "total_duration": _ns(_elapsed(timings)),
                             "load_duration": _ns(timings.load_wait),
                             "prompt_eval_count": count})

    async def embeddings_legacy(self, request: Request) -> JSONResponse:
        # Ollama's first embedding route: one `prompt`, one vector, not normalized.
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        _, model = await _model(body, self.coordinator)
        items = _texts(body.get("prompt"), "prompt", tokens_allowed=False)
        if len(items) != 1:
            raise RequestError("prompt must be a string")
        embeddings, _ = await self._vectors(request, model, items, _context(body, model), True,
                                            False, timings, _pooling(body, model))
        return JSONResponse({"embedding": embeddings[0]})

    async def openai_embeddings(self, request: Request) -> JSONResponse:
        timings = RequestTimings()
        body = await read_json_body(request, self.limits.max_body_bytes)
        name, model = await _model(body, self.coordinator)
        items = _texts(body.get("input"), "input", tokens_allowed=True)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise RequestError("encoding_format must be 'float' or 'base64'")
        dims = _dimensions(body, model.config.hidden_size)
        # OpenAI refuses an input over the context; it never truncates.
        embeddings, count = await self._vectors(request, model, items, model.context_len, False,
                                                True, timings, _pooling(body, model))
        embeddings = shorten(embeddings, dims)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(v) if fmt == "base64" else v}
                for i, v in enumerate(embeddings)]
        return JSONResponse({"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": count, "total_tokens": count}})


def _max_inputs(model: ServedModel) -> int:
    """Inputs per request: MAX_EMBED_INPUTS, and fewer for a model whose vectors would not
    fit the worker's reply (each float ~5 bytes in protobuf, plus framing per vector)."""
    return max(1, min(MAX_EMBED_INPUTS, MAX_REPLY_BYTES // (model.config.hidden_size * 5 + 16)))


def _dimensions(body: dict[str, Any], hidden: int) -> int | None:
    """`dimensions` (OpenAI's and Ollama's /api/embed): 1..the model's embedding size."""
    dims = body.get("dimensions")
    if dims is None:
        return None
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= hidden:
        raise RequestError(f"dimensions must be an integer between 1 and {hidden}, this "
                           f"model's embedding size (got {shown(json.dumps(dims), 60)})")
    return dims


def shorten(vectors: list[list[float]], dims: int | None) -> list[list[float]]:
    """Each vector's first `dims` values, L2-normalized again, as Ollama does (a zero vector
    stays zero). A mean-pooled chat model is not trained for it as Matryoshka embedders
    are: the short vector keeps less of the meaning, which is the caller's trade."""
    if dims is None:
        return vectors
    out = []
    for v in vectors:
        head = v[:dims]
        norm = math.sqrt(sum(x * x for x in head))
        out.append([x / norm for x in head] if norm > 0 else head)
    return out


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32 values."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _elapsed(t: RequestTimings) -> float:
    return time.monotonic() - t.arrival
