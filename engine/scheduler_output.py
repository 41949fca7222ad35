"""What one scheduler step decided: the chunks of this forward pass and the requests it
preempted. The runner executes it; the connector reads it to save each chunk's KV. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start_pos: int  # == request.num_computed_tokens when scheduled
    num_tokens: int  # tokens of request.token_ids[start_pos:] in this pass
    samples: bool  # the pass reaches the request's last token, so it yields a new token
    # Speculative decoding: draft tokens computed after the request's last token in this pass
    # (their KV is written too; the slots of rejected ones are rolled back by
    # Scheduler.update_from_output). Empty for every other chunk.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """What this chunk costs of the pass's token budget: its tokens and its drafts."""
        return self.num_tokens + len(self.draft_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted by this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_scheduled_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
