"""vLLM's /tokenize, /detokenize and /tokenizer_info, with its request and response shapes (the
table is coordinator/routes.py):

    POST /tokenize   {"model"?, "prompt"}   or {"model"?, "messages", "tools"?}
                     -> {"tokens": [...], "count": N, "max_model_len": M, "token_strs": null}
    POST /detokenize {"model"?, "tokens"}   -> {"prompt": "..."}
    GET  /tokenizer_info[?model=NAME]
                     -> {"tokenizer_class", "eos_token", "bos_token", "add_bos_token",
                         "model_max_length", "chat_template"}

`model` may be left out, as vLLM allows (lm-eval's remote tokenizer sends none), while the
cluster serves one model; with several it names one or the request is a 400.

A prompt is tokenized as /v1/completions tokenizes it (BOS by the model's rule); messages are
rendered through the chat template as /v1/chat/completions renders them, so `count` is the
`usage.prompt_tokens` that request would report. vLLM's `add_special_tokens`,
`add_generation_prompt` and `return_token_strs` are honoured. Rendering and tokenizing run off
the event loop (prompts.off_loop). Errors are OpenAI-shaped, as vLLM's are.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from coordinator.http_stream import read_json_body
from coordinator.model import ServedModel
from coordinator.ollama_request import RequestError
from coordinator.openai_api import parse_messages
from coordinator.prompts import encode, off_loop
from coordinator.service import Coordinator


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {json.dumps(value)[:60]}")
    return value


def _served(coordinator: Coordinator, model: Any) -> ServedModel:
    """The served model `model` names (a 404 for any other), or the only one when it is None."""
    if model is None:
        if len(coordinator.models) != 1:
            raise RequestError(f"model is required: {len(coordinator.models)} models are served")
        return coordinator.models.default
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a model's name")
    return coordinator.models.get(model)


def tokenize(model: ServedModel, body: dict[str, Any], max_messages: int) -> dict[str, Any]:
    """The /tokenize answer (renders and tokenizes: call it off the loop)."""
    tokenizer = model.tokenizer
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise RequestError("give exactly one of prompt (a string) and messages (a list)")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string")
        if "tools" in body:  # a prompt is tokenized as given: tools would be silently dropped
            raise RequestError("tools go with messages (the chat template renders them), not with prompt")
        text = prompt
    else:
        messages, tools = parse_messages(body, max_messages)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=_flag(body, "add_generation_prompt", True),
            tools=tools)
    ids = encode(tokenizer, text, add_special_tokens=_flag(body, "add_special_tokens", True))
    strs = ([tokenizer.id_to_token(i) for i in ids]
            if _flag(body, "return_token_strs", False) else None)
    return {"count": len(ids), "max_model_len": model.context_len, "tokens": ids,
            "token_strs": strs}


def detokenize(model: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RequestError("tokens must be a list of token ids (integers)")
    return {"prompt": model.tokenizer.decode(tokens)}  # an id outside the vocab: a 400


def tokenizer_info(model: ServedModel) -> dict[str, Any]:
    """What lm-eval's RemoteTokenizer reads (eos_token above all: its `prefix_token_id` for a
    loglikelihood request with an empty context is the id /tokenize gives that text). vLLM
    answers its tokenizer's init kwargs and class name; tandem's is a `tokenizers` vocabulary,
    which Hugging Face's PreTrainedTokenizerFast wraps, so that is the class it names."""
    tok = model.tokenizer
    text = lambda i: None if i is None else tok.id_to_token(i)  # noqa: E731
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": text(tok.eos_token_id),
            "bos_token": text(tok.bos_token_id), "add_bos_token": tok.add_bos,
            "model_max_length": model.context_len, "chat_template": tok.chat_template}


class TokenRoutes:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.limits = coordinator.config

    async def _body(self, request: Request) -> tuple[dict[str, Any], ServedModel]:
        """The request's body and the served model it names (_served)."""
        body = await read_json_body(request, self.limits.max_body_bytes)
        return body, _served(self.coordinator, body.get("model"))

    async def tokenize(self, request: Request) -> JSONResponse:
        body, model = await self._body(request)
        return JSONResponse(await off_loop(tokenize, model, body, self.limits.max_messages))

    async def detokenize(self, request: Request) -> JSONResponse:
        body, model = await self._body(request)
        return JSONResponse(await off_loop(detokenize, model, body))

    async def tokenizer_info(self, request: Request) -> JSONResponse:
        model = _served(self.coordinator, request.query_params.get("model"))
        return JSONResponse(tokenizer_info(model))
