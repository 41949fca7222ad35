r"""A request's state inside one engine, and its life cycle.

    WAITING ──schedule──> RUNNING ──(stop / length / abort)──> FINISHED_*
       ^   \                 │
       │    └─> WAITING_FOR_REMOTE_KV (decode worker: blocks reserved, KV arriving) ─> RUNNING
       └──── PREEMPTED <─────┘ (out of KV blocks: blocks freed, recomputed later)

A request that takes part in a KV transfer carries `kv_transfer` (engine/kv_connector.py) and
a `kv_state` beside its status:

    decode:   NONE -> RECEIVING (blocks reserved, granted) -> RECEIVED (all KV + first token)
    prefill:  NONE -> SENDING (layers handed to the sender)
    either, once FINISHED_* while a transfer may still touch its blocks:
              -> DRAINING (blocks held by the scheduler) -> RELEASED (blocks freed)

Token bookkeeping: `token_ids` is prompt + generated tokens so far. `num_computed_tokens` is
how many of them have K/V in this engine's cache. A request needs a forward pass over
token_ids[num_computed_tokens:]; when that pass reaches the last token it yields a new token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_transfer_state import KVTransferParams, KVTransferState
from engine.pass_record import PassRecord
from common.logprobs import TokenLogprob
from common.pooling import Pooling
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.request_grammar import RequestGrammar


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
    kv_transfer: KVTransferParams | None = None  # set when a connector moves this request's KV
    # Trailing prompt tokens that an earlier placement of this request generated (it moved
    # here after a worker died): prompt to the model, but output to its grammar.
    num_prior_output_tokens: int = 0
    kv_state: KVTransferState = KVTransferState.NONE
    # Structured output: the request's grammar matcher, made by the engine at its first draw
    # and advanced over output_token_ids before each mask (engine/grammar.py's invariant).
    grammar: RequestGrammar | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): entry i is prompt token i + 1's, filled
    # chunk by chunk as the prefill passes compute them; kept across a preemption, so that a
    # recompute adds none twice.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # An embedding request (engine/embedding.py): its prompt is computed chunk by chunk under
    # the token budget like any prompt, its final hidden states pooled as the passes go;
    # it samples nothing and finishes (FINISHED_STOPPED) once the whole prompt is computed.
    pooling: Pooling | None = None  # an embedding request's pooling; None for any other
    normalize: bool = True  # pooling: L2-normalize the pooled vector
    # The prefix-cache tenant (common/block_hash.py): the request reuses and registers only
    # blocks of the same salt. b"": the shared cache.
    cache_salt: bytes = b""
    # Speculative decoding (engine/speculative.py): tokens proposed to follow token_ids, set
    # by the engine before a step and consumed by that step's schedule; never part of
    # token_ids until the target model accepts them.
    draft_token_ids: list[int] = field(default_factory=list)
    # Observability, set by the worker, never read by the engine's decisions: the client's
    # request id (common/request_id.py) for log lines written on the engine thread about this
    # request, and, while traces are on, a record of each pass that computed part of it
    # (engine/pass_record.py), appended by LLMEngine.step.
    log_id: str = ""
    passes: list[PassRecord] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not 0 <= self.num_prior_output_tokens < len(self.prompt_token_ids):
            raise ValueError(f"num_prior_output_tokens {self.num_prior_output_tokens} must be in "
                             f"[0, {len(self.prompt_token_ids)})")
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
    def generated_token_ids(self) -> list[int]:
        """Everything this request has generated, on earlier placements too."""
        return self.token_ids[self.num_prompt_tokens - self.num_prior_output_tokens:]

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
