"""Log probabilities in each API's shape. The engine's entries (common/logprobs.py: token ids
and raw-distribution logprobs) get their text here, from the coordinator's tokenizer: each id
decoded alone, with special tokens, and its UTF-8 bytes (a token that is part of a multi-byte
character decodes to U+FFFD; its bytes then say less than the model's own byte token would).

    Ollama (both routes)      logprobs: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]
    OpenAI chat               choices[].logprobs: {content: [same as Ollama's entries]}
    OpenAI completions        choices[].logprobs: {tokens, token_logprobs, top_logprobs: [{token: logprob}],
                                                    text_offset}
Streams carry, in each chunk, the entries of the tokens that arrived since the last chunk.
Completions' `echo` puts the prompt tokens' entries first (prompt_completion_logprobs), the first
prompt token's logprob and top_logprobs null, as OpenAI and vLLM send them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.logprobs import TokenLogprob
from common.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _one(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def content_entries(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Ollama's `logprobs` list, and OpenAI chat's `logprobs.content` (the same shape)."""
    return [{**_one(tokenizer, e.token_id, e.logprob),
             "top_logprobs": [_one(tokenizer, t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob],
                        offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' legacy shape. text_offset: each token's start in the completion
    text, counting from `offset` (the characters earlier chunks carried), by the token texts'
    lengths."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(token_text(tokenizer, e.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def prompt_completion_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                               entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The prompt's tokens in completions' shape (echo): `entries` are prompt tokens 1.. (the
    engine's SamplingParams.prompt_logprobs); token 0 has no logprob, so null."""
    first = token_text(tokenizer, prompt_ids[0])
    rest = completion_logprobs(tokenizer, entries, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def join_completion_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shaped logprobs objects, one after the other."""
    return {key: [*first[key], *then[key]] for key in first}
