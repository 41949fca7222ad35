"""Thinking models: Ollama's `think` and `message.thinking`.

A template that can think (Qwen3's, DeepSeek-R1's: it reads `enable_thinking` or writes
`<think>`) is rendered with `enable_thinking` set from the request's `think` (true, false, or
one of Ollama's levels "low"/"medium"/"high", which also reach the template as
`reasoning_effort`); the answer's `<think>...</think>` block becomes `message.thinking` and the
rest `message.content`, streamed as it comes. Without `think` the template's default applies
and the output is returned as the model wrote it (Ollama's behaviour before `think` existed). A
template that cannot think answers `think: true` with Ollama's 400, and `think: false` as usual.

The splitter is a small state machine over the streamed text; a tag split across pieces is
held back until it is whole (as stop strings are), so neither field ever shows part of a tag:

    start --"<think>"--> thinking --"</think>"--> after (spaces dropped) --> content
    start --anything else--> content
A prompt that already opened the block (the template wrote "<think>" last) starts in thinking.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from coordinator.ollama_request import RequestError
from coordinator.tool_calls import ToolCall, ToolCallParser

OPEN, CLOSE = "<think>", "</think>"


def supports_thinking(template: str | None) -> bool:
    return template is not None and ("enable_thinking" in template or OPEN in template)


def template_args(think: bool | str | None, template: str | None, model: str) -> dict[str, Any]:
    """The template variables a request's `think` sets; Ollama's 400 for a model that cannot."""
    if think is None or think is False and not supports_thinking(template):
        return {}
    if not supports_thinking(template):
        raise RequestError(f'"{model}" does not support thinking')
    args: dict[str, Any] = {"enable_thinking": bool(think)}
    if isinstance(think, str):
        args["reasoning_effort"] = think
    return args


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Streamed output -> (thinking, content) pieces. `push` each piece, `finish` at the end."""

    def __init__(self, started: bool = False) -> None:
        self.state = "opened" if started else "start"
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        thought = content = ""
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(OPEN):
                    self.state, buf = "opened", stripped[len(OPEN):]
                elif not stripped or OPEN.startswith(stripped):
                    self._held, buf = buf, ""  # may still become "<think>"
                else:
                    self.state = "content"
            elif self.state in ("opened", "after"):  # spaces after a tag are no one's text
                buf = buf.lstrip()
                if buf:
                    self.state = "thinking" if self.state == "opened" else "content"
            elif self.state == "thinking":
                end = buf.find(CLOSE)
                if end >= 0:
                    thought += buf[:end]
                    self.state, buf = "after", buf[end + len(CLOSE):]
                else:
                    keep = _partial_suffix(buf, CLOSE)
                    thought += buf[:len(buf) - keep]
                    self._held, buf = buf[len(buf) - keep:], ""
            else:
                content, buf = content + buf, ""
        return thought, content

    def finish(self) -> tuple[str, str]:
        """The held text at the end: an unfinished tag is text of the part it stood in."""
        held, self._held = self._held, ""
        if self.state in ("opened", "thinking"):
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """A whole output at once."""
        a, b = self.push(text)
        c, d = self.finish()
        return a + c, b + d


def opens_thinking(tokenizer: Any, generation: Any) -> bool:
    """Whether the rendered prompt already opened the block (the template wrote "<think>")."""
    tail = tokenizer.decode(generation.request.prompt_ids[-8:])
    return tail.rstrip().endswith(OPEN)


async def split_thinking(pieces: AsyncIterator[str], thinking: ThinkSplitter | None,
                         calls: ToolCallParser | None
                         ) -> AsyncIterator[tuple[str, str, list[ToolCall]]]:
    """A streamed output as (thinking, content, calls completed) parts: the thinking split off
    first, then the content through the tool-call parser when there is one."""
    def parts(thought: str, content: str) -> tuple[str, str, list[ToolCall]]:
        if calls is None or not content:
            return thought, content, []
        return (thought, *calls.push(content))

    async for piece in pieces:
        yield parts(*(thinking.push(piece) if thinking is not None else ("", piece)))
    if thinking is not None:
        yield parts(*thinking.finish())
    if calls is not None:
        yield ("", *calls.finish())
