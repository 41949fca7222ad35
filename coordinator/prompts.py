"""Requests -> prompt token ids, the same for every client API (Ollama, OpenAI, gRPC).

The coordinator renders the model's own chat template (Jinja, from the GGUF or the HF
tokenizer_config) and tokenizes; workers only ever see token ids.

/api/generate follows Ollama: without `raw` the prompt becomes one user message (after the
request's `system` message, if any) rendered through the chat template; with `raw` it is
tokenized as given. `context` (token ids an earlier /api/generate returned) goes in front, so a
client can continue a conversation, as with Ollama.

The event loop never tokenizes (issue 15): the routes call `off_loop(...)`, which runs these
functions on a small thread pool, and the engine's Tokenizer releases the GIL while it
tokenizes (a 4 MB prompt would otherwise stall every other request, and the registry's
heartbeats, for seconds). Before tokenizing, a text is measured against the context: no token
of the vocabulary spells more than `tokenizer.max_token_bytes` bytes, so a text of more than
`max_token_bytes * context` UTF-8 bytes needs more tokens than the context holds and is refused
(400) without being tokenized.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from coordinator.model import ServedModel
from common.errors import ContextLengthError

T = TypeVar("T")

# Rendering and tokenizing run here, never on the event loop. Two threads: one huge prompt does
# not hold up every other request's tokenization, and tokenizing cannot take every core.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-tokenize")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the tokenizing threads; the event loop keeps serving."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


# ---- the cheap size check -----------------------------------------------------------------------

def check_text_size(tokenizer: Any, text: str, context: int | None) -> None:
    """Refuse a text that surely has more tokens than `context`, by its byte length alone."""
    per_token = getattr(tokenizer, "max_token_bytes", 0)
    if context is None or per_token <= 0:
        return
    limit = per_token * context
    if len(text) * 4 <= limit:  # a char is at most 4 UTF-8 bytes: surely small enough
        return
    size = len(text.encode("utf-8", "surrogatepass"))  # ~1 ms for 4 MB
    if size > limit:
        raise ContextLengthError(
            f"the prompt is {size} bytes: more than the {context}-token context window can hold "
            f"(no token of this model spells more than {per_token} bytes, so it would be over "
            f"{size // per_token} tokens)")


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True,
           context: int | None = None, embedding: bool = False) -> list[int]:
    """embedding: an embedding input (common/tokenizer.py: it ends with the vocabulary's
    end-of-text token where it has one)."""
    check_text_size(tokenizer, text, context)
    if embedding:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, embedding=True)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---- the prompts of each API --------------------------------------------------------------------

def chat_prompt_ids(model: ServedModel, messages: list[dict],
                    tools: list[dict] | None = None, context: int | None = None,
                    template_args: dict | None = None) -> list[int]:
    """`context`: the request's context window in tokens (None: no size check);
    `template_args`: variables for the chat template (coordinator/thinking.py's)."""
    tokenizer = model.tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                           **(template_args or {}))
    return encode(tokenizer, prompt, add_special_tokens=True, context=context)


@dataclass(frozen=True)
class FittedChat:
    prompt_ids: list[int]
    dropped_messages: int  # the oldest non-system messages left out so that the chat fits
    dropped_tokens: int  # how many prompt tokens that saved


def fit_chat(model: ServedModel, messages: list[dict], tools: list[dict] | None,
             context: int, template_args: dict | None = None) -> FittedChat:
    """Ollama's truncation: a conversation whose prompt leaves no room in `context` for one
    generated token drops its oldest non-system messages, the fewest that make it fit (the
    system messages and the last message always stay). Found by bisection over how many to
    drop, so a long history costs O(log n) renders, not n. A chat that cannot fit even then is
    returned whole: prepare() answers it with the context-length 400."""
    full = chat_prompt_ids(model, messages, tools, None, template_args)
    if len(full) < context:
        return FittedChat(full, 0, 0)
    droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]

    def without(n: int) -> list[int]:
        gone = set(droppable[:n])
        return chat_prompt_ids(model, [m for i, m in enumerate(messages) if i not in gone],
                               tools, None, template_args)

    lo, hi = 1, len(droppable)  # invariant: dropping hi fits, if anything does
    if not droppable or len(best := without(hi)) >= context:
        return FittedChat(full, 0, 0)
    while lo < hi:
        mid = (lo + hi) // 2
        ids = without(mid)
        if len(ids) < context:
            hi, best = mid, ids
        else:
            lo = mid + 1
    return FittedChat(best, hi, len(full) - len(best))


def generate_prompt_ids(model: ServedModel, prompt: str, system: str | None = None,
                        raw: bool = False, context: list[int] | None = None,
                        context_window: int | None = None,
                        template_args: dict | None = None) -> list[int]:
    """`template_args`: variables for the chat template (coordinator/thinking.py's); a raw
    prompt is sent as given, without the template."""
    tokenizer = model.tokenizer
    if raw:
        text = prompt
    else:
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **(template_args or {}))
    room = None if context_window is None else context_window - len(context or [])
    room = room if room is None or room > 0 else None  # no room at all: prepare() says so
    ids = encode(tokenizer, text, add_special_tokens=not context, context=room)
    return [*(context or []), *ids]


def completion_prompt_ids(model: ServedModel, prompt: str | list[int],
                          context: int | None = None) -> list[int]:
    """OpenAI /v1/completions: the prompt as given (text, or token ids), no template."""
    if isinstance(prompt, list):
        return list(prompt)
    return encode(model.tokenizer, prompt, add_special_tokens=True, context=context)
