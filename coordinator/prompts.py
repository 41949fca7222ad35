"""Requests -> prompt token ids, the same for every client API (Ollama, OpenAI, gRPC).

The coordinator renders the model's own chat template (Jinja, from the GGUF or the HF
tokenizer_config) and tokenizes; workers only ever see token ids.

/api/generate follows Ollama: without `raw` the prompt becomes one user message (after the
request's `system` message, if any) rendered through the chat template; with `raw` it is
tokenized as given. `context` (token ids an earlier /api/generate returned) goes in front, so a
client can continue a conversation, as with Ollama.
"""

from __future__ import annotations

from coordinator.model import ServedModel


def chat_prompt_ids(model: ServedModel, messages: list[dict],
                    tools: list[dict] | None = None) -> list[int]:
    tokenizer = model.tokenizer
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return tokenizer.encode(prompt, add_special_tokens=True)


def generate_prompt_ids(model: ServedModel, prompt: str, system: str | None = None,
                        raw: bool = False, context: list[int] | None = None) -> list[int]:
    tokenizer = model.tokenizer
    if raw:
        ids = tokenizer.encode(prompt, add_special_tokens=not context)
    else:
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=not context)
    return [*(context or []), *ids]


def completion_prompt_ids(model: ServedModel, prompt: str | list[int]) -> list[int]:
    """OpenAI /v1/completions: the prompt as given (text, or token ids), no template."""
    if isinstance(prompt, list):
        return list(prompt)
    return model.tokenizer.encode(prompt, add_special_tokens=True)
