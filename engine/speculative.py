"""Speculative decoding inside the running batch: propose before a step, verify after it.

    engine.step():
      propose(running)     each eligible decode gets request.draft_token_ids from the
                           proposer (engine/proposer.py: prompt lookup, engine/ngram_proposer.py,
                           or a draft model, engine/draft_proposer.py), at most what
                           max_tokens leaves; a draft model's q rows are kept here until verify
      schedule             the chunk is [last token] + drafts, 1 + k tokens of the budget, with
                           blocks for every draft slot (engine/scheduler.py)
      execute              one pass; k + 1 logit rows for that chunk (engine/model_runner.py)
      verify(...)          the run: accepted drafts + the target's token
                           (engine/rejection_sampler.py), under the request's own sampling
                           rules: logit_bias, min_tokens' stop-token mask per row, filters,
                           temperature, seed per position
      update_from_output   appends the run up to a stop, rolls back the rejected slots

Who speculates: decodes (the request's last token is its only uncomputed one) that did not opt
out (SamplingParams.speculative false) without a grammar, logprobs, prompt logprobs or
penalties: each of those depends on the tokens before it
in ways a batch of rows cannot see cheaply, so they decode one token a step as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from engine.ngram_proposer import NgramProposer
from engine.proposer import Proposer
from engine.rejection_sampler import accept_greedy, rejection_sample
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, apply_logit_bias, forbid_tokens, position_generator, probabilities
from engine.speculative_config import SpeculativeConfig


STEP_EMA = 0.1  # weight of the newest step in SpeculativeDecoder's step-time averages
PLAIN_STEP_EVERY = 32  # propose() calls between plain steps that refresh the plain average


@dataclass
class SpecDecodeStats:
    """Engine-wide counters since the engine started (monotonic)."""

    method: str = "ngram"  # SpeculativeConfig.method: which proposer these count
    num_steps: int = 0  # verifications: a request's pass that carried a draft
    num_draft_tokens: int = 0  # draft tokens verified (vLLM: spec_decode_num_draft_tokens)
    num_accepted_tokens: int = 0  # of which accepted (vLLM: spec_decode_num_accepted_tokens)
    num_emitted_tokens: int = 0  # tokens those verifications appended (accepted + the target's)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification emits on average (1.0 = no gain)."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0


def speculates(request: Request) -> bool:
    """Whether `request` may carry a draft (module docstring)."""
    p = request.sampling_params
    penalised = p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                          or p.presence_penalty != 0.0)
    return (p.speculative and request.status is RequestStatus.RUNNING and not request.pooling
            and request.num_output_tokens > 0
            and request.num_computed_tokens == request.num_tokens - 1
            and p.grammar is None and p.logprobs is None and p.prompt_logprobs is None
            and not penalised)


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, sampler: Sampler,
                 proposer: Proposer | None = None) -> None:
        """proposer: the draft model's (engine/draft_proposer.py), required for method
        "draft", which the engine builds since it loads the model; ngram's is built here."""
        self.config = config
        self.sampler = sampler
        if config.method == "draft" and proposer is None:
            raise ValueError("speculative method draft needs its draft model's proposer")
        self.proposer: Proposer = proposer if proposer is not None else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodeStats(method=config.method)
        # request id -> the q rows of its current draft (a draft model's sampled draft only),
        # from propose to the verify of the same step; replaced at every propose.
        self._draft_probs: dict[str, torch.Tensor] = {}
        # Moving averages of a whole decode step's seconds (proposing included), plain and with
        # drafts (observe_step); their ratio gates drafting (engine/draft_length.py). Unknown
        # until each kind has run: 1.0, so speculation is tried first.
        self.plain_step_s: float | None = None
        self.drafted_step_s: float | None = None
        self._proposals = 0  # propose() calls, for the plain steps that keep plain_step_s current

    @property
    def cost_ratio(self) -> float:
        if self.plain_step_s is None or self.drafted_step_s is None:
            return 1.0
        return self.drafted_step_s / self.plain_step_s

    def observe_step(self, seconds: float, drafted: bool, batch_size: int) -> None:
        """A step of decodes only (no prompt chunk) took `seconds`. Kept per batch size 1
        ratio-wise: a step's time is divided by its sequences, so batches of another size
        still compare (the ratio is what matters, not the absolute)."""
        per_sequence = seconds / max(batch_size, 1)
        if drafted:
            self.drafted_step_s = _moving_average(self.drafted_step_s, per_sequence)
        else:
            self.plain_step_s = _moving_average(self.plain_step_s, per_sequence)

    def propose(self, requests: Iterable[Request]) -> None:
        """Sets each request's draft_token_ids for the next schedule ([] where it does not
        speculate). A draft never reaches past max_tokens: the run it yields is at most
        its length + 1 tokens."""
        wanted = []
        for request in requests:
            request.draft_token_ids = []
            if speculates(request):
                limit = request.max_tokens - request.num_output_tokens - 1
                if limit > 0:
                    wanted.append((request, limit))
        self._draft_probs = {}
        self._proposals += 1
        # A plain step now and then (and one right after the first drafted step) measures
        # what drafting is weighed against; without it a workload that keeps drafting a little
        # would never learn that its drafts cost more than they give.
        # Greedy requests only: a sampled one's drafts follow from its own history alone
        # (engine/draft_length.py).
        if wanted and ((self.plain_step_s is None and self.drafted_step_s is not None)
                       or self._proposals % PLAIN_STEP_EVERY == 0):
            wanted = [(r, n) for r, n in wanted if not r.sampling_params.greedy]
        self.proposer.cost_ratio = self.cost_ratio
        drafts = self.proposer.propose_drafts(wanted) if wanted else {}
        for request, _ in wanted:
            draft = drafts.get(request.request_id)
            if draft is not None and draft.token_ids:
                request.draft_token_ids = list(draft.token_ids)
                if draft.probs is not None:
                    self._draft_probs[request.request_id] = draft.probs

    def forget(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self.proposer.forget(request_id)

    def verify(self, request: Request, draft: Sequence[int], logits: torch.Tensor,
               generator: Callable[[int], torch.Generator]) -> list[int]:
        """The run for `request` from its k + 1 logit rows [k + 1, V] (row i: after draft[:i]).
        generator(i): the generator of row i's draw (the token at position num_tokens + i)."""
        k = len(draft)
        params = request.sampling_params
        rows = [params] * (k + 1)
        # min_tokens: row i draws output token number (outputs so far + i): its stop tokens are
        # masked while that is below min_tokens, as when each is drawn alone.
        done = request.num_output_tokens + request.num_prior_output_tokens
        logits = forbid_tokens(logits, [request.stop_token_ids if done + i < params.min_tokens
                                        else () for i in range(k + 1)])
        if params.greedy:
            histories = [request.token_ids + list(draft[:i]) for i in range(k + 1)]
            targets = self.sampler.sample(logits, rows, histories, [None] * (k + 1)).tolist()
            run = accept_greedy(targets, draft)
        else:
            probs = probabilities(apply_logit_bias(logits, rows), rows)
            # The schedule may have cut the draft to the budget: q's rows follow it.
            q = self._draft_probs.get(request.request_id)
            run = rejection_sample(probs, draft, [generator(i) for i in range(k + 1)],
                                   None if q is None else q[:k])
        accepted = max(0, len(run) - 1)
        self.proposer.record(request.request_id, k, accepted)
        self.stats.num_steps += 1
        self.stats.num_draft_tokens += k
        self.stats.num_accepted_tokens += accepted
        return run

    def record_emitted(self, num_tokens: int) -> None:
        self.stats.num_emitted_tokens += num_tokens


def _moving_average(old: float | None, new: float) -> float:
    return new if old is None else old + STEP_EMA * (new - old)


def seeded_row_generators(seed: int, first_position: int) -> Callable[[int], torch.Generator]:
    """Row i's generator for a seeded request: the one a plain step drawing the token at
    first_position + i would use (engine/sampler.py position_generator)."""
    return lambda i: position_generator(seed, first_position + i)
