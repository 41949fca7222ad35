"""Several choices in one OpenAI request: `n` > 1 and /v1/completions' prompt lists.

Each choice is its own Generation (admitted, placed and cancelled like any request); they are
ordered prompt by prompt, `n` each, which is OpenAI's `index` order:

    prompts [p0, p1], n 2   ->   index 0: p0, 1: p0, 2: p1, 3: p1

The n choices of one prompt share a `Siblings`: the first one placed names its decode worker
and the others go to the same one (request_flow.py), and `merged` starts them only once the
first choice of their prompt has its first token, so the prompt's KV is in that worker's
prefix cache when they are placed (each then prefills only what the cache lacks). A seeded
request gives choice i of a prompt the seed + i (seed - i near the top of the range), so the
n samples differ yet repeat; greedy choices are equal, as they are on OpenAI.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from coordinator.generation import Generation
from coordinator.metrics import RequestTimings
from coordinator.model import ServedModel
from coordinator.request_flow import Siblings
from coordinator.service import Coordinator
from common.sampling_params import SamplingParams

T = TypeVar("T")
MAX_SEED = (1 << 63) - 1


@dataclass
class Choice:
    index: int  # OpenAI's choice index
    prompt: int  # which prompt of the request (0 without a prompt list)
    generation: Generation


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The sampling parameters of the i-th choice of one prompt."""
    if i == 0 or params.seed is None:
        return params
    seed = params.seed + i if params.seed + i <= MAX_SEED else params.seed - i
    return replace(params, seed=seed)


async def submit_choices(coordinator: Coordinator, prompts: Sequence[list[int]], n: int,
                         params: SamplingParams, timings: RequestTimings,
                         cache_salt: bytes = b"",
                         model: ServedModel | None = None,
                         turns: Sequence[str | None] = ()) -> list[Choice]:
    """Every choice admitted (Coordinator.submit), in index order; `timings` (started when the
    request arrived) are the first choice's, the others get their own. A refusal (a limit, no
    worker, overload) closes the ones admitted already and is raised. turns: each prompt's
    last user turn as text, for the semantic response cache (coordinator/response_cache.py)."""
    choices: list[Choice] = []
    try:
        for p, prompt_ids in enumerate(prompts):
            siblings = Siblings()
            for i in range(n):
                generation = await coordinator.submit(
                    prompt_ids, choice_params(params, i),
                    timings if not choices else RequestTimings(), cache_salt=cache_salt,
                    model=model, siblings=siblings, turn=turns[p] if p < len(turns) else None)
                choices.append(Choice(len(choices), p, generation))
    except BaseException:
        await close_all(choices)
        raise
    return choices


async def close_all(choices: Sequence[Choice]) -> None:
    for c in choices:
        await c.generation.close()


def usage(choices: Sequence[Choice]) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached tokens): each prompt counted once (its first
    choice's figures), every choice's completion tokens summed, as OpenAI counts n > 1."""
    firsts = {}
    for c in choices:
        firsts.setdefault(c.prompt, c.generation)
    return (sum(g.timings.prompt_tokens for g in firsts.values()),
            sum(c.generation.timings.output_tokens for c in choices),
            sum(g.outcome.cached_tokens for g in firsts.values()))


async def merged(choices: Sequence[Choice],
                 streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of every choice's stream, tagged with its index, as they come. A prompt's
    later choices start once its first one has a token (or ended). An exception of any stream ends
    the merge with it; closing the merge cancels and closes every stream."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()
    started: dict[int, asyncio.Event] = {}
    for c in choices:
        started.setdefault(c.prompt, asyncio.Event())

    async def pump(c: Choice, stream: AsyncIterator[T], first: bool) -> None:
        gate = started[c.prompt]
        if not first:
            await gate.wait()
        try:
            async for item in stream:
                if c.generation.output_ids:  # its prompt's KV is cached on its workers now
                    gate.set()
                await queue.put((c.index, item, None, False))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
            await queue.put((c.index, None, exc, True))
            return
        finally:
            gate.set()
        await queue.put((c.index, None, None, True))

    seen: set[int] = set()
    tasks = []
    for c, stream in zip(choices, streams):
        tasks.append(asyncio.ensure_future(pump(c, stream, c.prompt not in seen)))
        seen.add(c.prompt)
    left = len(tasks)
    try:
        while left:
            index, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                left -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
