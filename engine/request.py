r"""A request's state inside one engine, and its life cycle.

    WAITING ──schedule──> RUNNING ──(stop / length / abort)──> FINISHED_*
       ^   \                 │
       │    └─> WAITING_FOR_REMOTE_KV (decode worker: blocks reserved, KV arriving) ─> RUNNING
       └──── PREEMPTED <─────┘ (out of KV blocks: blocks freed, recomputed later)

Token bookkeeping: `token_ids` is prompt + generated tokens so far. `num_computed_tokens` is
how many of them have K/V in this engine's cache. A request needs a forward pass over
token_ids[num_computed_tokens:]; when that pass reaches the last token it yields a new token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # a stop token (or stop string, set by the caller)
    FINISHED_LENGTH = "finished_length"  # num_predict reached or the context is full
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the caller
    FINISHED_ERROR = "finished_error"  # failed inside tandem (e.g. a KV transfer)

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def done_reason(self) -> str | None:
        """Ollama's `done_reason` for a finished request."""
        return {"finished_stopped": "stop", "finished_length": "length",
                "finished_aborted": "abort", "finished_error": "error"}.get(self.value)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # generated tokens allowed (num_predict and the context both applied)
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first allocation)
    token_ids: list[int] = field(init=False)
    first_token_time: float | None = None
    max_chunk_tokens: int = 0  # largest prefill chunk per pass for this request; 0 = no own cap

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop(self) -> RequestStatus | None:
        """The finished state a newly appended token puts this request in, if any."""
        if self.num_output_tokens and self.token_ids[-1] in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
