"""Chat messages -> prompt text, rendering a model's Jinja chat template the way Hugging Face does.

The environment copies transformers' `_compile_jinja_template` (sandboxed, trim_blocks,
lstrip_blocks, loopcontrols, `raise_exception`, an HF-style `tojson`, `strftime_now`), and the
inputs get the same clean-up as `apply_chat_template` (keys whose value is None dropped,
reasoning aliases filled), so a template renders byte-for-byte as transformers renders it.
Templates come from model files, so they are untrusted code: the sandbox keeps them from
reaching Python internals, and any failure inside them is reported as a ChatTemplateError.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import ChatTemplateError, InvalidOptionError

# What llama.cpp and Ollama fall back to for a model without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning travels under; templates read the first (transformers' aliasing).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    tools: list[dict] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template` (ChatML when None). `extra` reaches the template as variables."""
    messages = _normalize_messages(messages)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidOptionError("tools must be a list of JSON-schema objects")
    compiled = _compile(template if template is not None else CHATML_TEMPLATE)
    # As in transformers, the special tokens are variables that caller-supplied ones override.
    variables = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    variables.update(extra)
    try:
        return compiled.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except Exception as exc:  # untrusted template code: any failure is the template's (or input's) fault
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


MAX_TEMPLATE_CHARS = 256 * 1024  # the largest published chat templates are ~20 KB


def check_template(template: str) -> str:
    """`template` if it parses as a Jinja chat template; ChatTemplateError naming the problem
    otherwise (an Ollama Go template, `{{ .Prompt }}`, is named as such: tandem renders Jinja)."""
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError("a chat template must be non-empty Jinja text")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"a chat template may have at most {MAX_TEMPLATE_CHARS} "
                                f"characters, got {len(template)}")
    try:
        _compile(template)
    except ChatTemplateError as exc:
        if re.search(r"\{\{-?\s*\.", template):
            raise ChatTemplateError(
                "the chat template looks like an Ollama Go template ({{ .Prompt }}); tandem "
                "renders Jinja chat templates as Hugging Face does (tokenizer_config.json's "
                f"chat_template): {exc}") from None
        raise
    return template


def _normalize_messages(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidOptionError("messages must be a non-empty list of objects")
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidOptionError(f"each message must be an object, got {type(message).__name__}")
        # APIs send `content: null`; templates handle a missing key but print "None" for a null one.
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which changes the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates without the type itself, so templates cannot reach it for type tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, which would reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc
