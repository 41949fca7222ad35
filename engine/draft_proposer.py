"""A draft model as proposer: a smaller model of the target's vocabulary drafts k tokens.

State: the draft keeps its own paged KV cache, a ModelRunner over its own pool, with its
own BlockManager (prefix caching off: the draft's blocks are never shared, so rolling back
is a trim). Per request it remembers `seen`, the tokens whose KV its cache holds, at
positions 0..len(seen)-1. A per-request dict of tensors would be simpler, but the paged pool
reuses the runner, the attention kernels and the block arithmetic the target already has,
and batches every speculating request into one pass per draft position.

Each step (propose_drafts), for each request with tokens t[0..L) and room for n drafts:

    keep = common prefix of seen and t, at most L - 1   (roll back: the rejected drafts'
                                                         KV, and always re-feed t[L-1],
                                                         whose logits give the first draft)
    pass 0      feed t[keep..L) (the whole prompt at a request's first step: the draft
                prefills it here, since the prefill worker only computes the target's KV)
                -> d0 from the last row
    pass j      feed d(j-1) at position L + j - 1 -> dj, for j = 1..n-1

so afterwards seen = t + d[0..n-1) and the request's table covers L + n - 1 slots; the
next step's common prefix drops whatever the target rejected. The pool has as many blocks
of the same size as the target's: the draft never holds more than the target's tokens plus
k - 1, and where its pool is short the request simply gets no draft this step.

Draws: a greedy request takes the argmax (a point mass: Draft.probs None). A sampled
request draws from q = the draft's logits under the request's own logit_bias, filters and
temperature, and q's rows go with the draft for the rejection sampler (engine/
rejection_sampler.py), which keeps the output distributed as the target's whatever q is.
A seeded request's draft draws use position_generator(seed, -1 - position): negative
positions, which the target's draws (positions >= 0) never use, so the draft's randomness
is independent of the verifier's and still reproducible.

Draft length: n = min(adaptive k, room) per request (engine/draft_length.py): a request whose
drafts the target keeps rejecting drafts nothing but a one-token probe every few steps, so it
costs neither the k draft passes nor the wider verification. Its `seen` then lags its tokens,
and the next draft it makes catches up on them in pass 0 (one chunk, as the prompt was).

Ownership: the draft pool's blocks belong to this proposer only; forget() frees a
request's blocks and state, and the engine calls it at every finish, abort and migration.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.draft_length import DraftLength
from engine.model_runner import ModelRunner, SequenceChunk
from engine.proposer import Draft
from engine.request import Request
from engine.sampler import apply_logit_bias, make_generator, position_generator, probabilities

SAMPLE_CHECK_TOKENS = (0, 1, 2, 100, 1000)  # token ids whose strings must agree (and the last)


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_tokenizer=None,
                          draft_tokenizer=None) -> None:
    """ValueError unless the draft's vocabulary is the target's: the same size and, when both
    tokenizers are at hand, the same strings at a few ids (first, some middle, last)."""
    if target_vocab != draft_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's "
                         f"{target_vocab}: a draft must share the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    for token_id in sorted({t for t in SAMPLE_CHECK_TOKENS if t < target_vocab} | {target_vocab - 1}):
        ours, theirs = target_tokenizer.id_to_token(token_id), draft_tokenizer.id_to_token(token_id)
        if ours != theirs:
            raise ValueError(f"the draft model's token {token_id} is {theirs!r}, the target's "
                             f"{ours!r}: a draft must share the target's tokenizer")


class DraftModelProposer:
    def __init__(self, model, k: int, cache: CacheConfig, kv_dtype: torch.dtype) -> None:
        self.model = model
        self.k = k
        draft_cache = CacheConfig(block_size=cache.block_size, num_blocks=cache.num_blocks,
                                  enable_prefix_caching=False, kv_dtype=cache.kv_dtype)
        self.blocks = BlockManager(draft_cache.num_blocks, draft_cache.block_size,
                                   enable_prefix_caching=False)
        # No CUDA graphs: the draft's passes are small and vary in shape.
        self.runner = ModelRunner(model, draft_cache, kv_dtype, cuda_graphs=False)
        self.seen: dict[str, list[int]] = {}  # request id -> tokens whose KV the pool holds
        self.lengths: dict[str, DraftLength] = {}  # request id -> its adaptive draft length
        self.cost_ratio = 1.0  # a drafted step's cost over a plain one (SpeculativeDecoder sets it)
        self._generators: dict[str, torch.Generator] = {}  # unseeded sampled requests

    @property
    def states(self) -> dict[str, list[int]]:
        """Per-request state, for leak checks (empty once every request is forgotten)."""
        return {rid: self.seen.get(rid, []) for rid in {*self.seen, *self.lengths}}

    def propose_drafts(self, wanted: Sequence[tuple[Request, int]]) -> dict[str, Draft]:
        active: list[tuple[Request, int]] = []  # (request, drafts to make)
        chunks: list[SequenceChunk] = []
        for request, limit in wanted:
            rid, tokens = request.request_id, request.token_ids
            length = self.lengths.get(rid)
            if length is None:
                length = self.lengths[rid] = DraftLength()
            ratio = self.cost_ratio if request.sampling_params.greedy else 1.0
            n = min(length.draft_length(self.k, ratio), limit)
            if n <= 0:
                continue
            seen = self.seen.setdefault(rid, [])
            keep = 0
            for a, b in zip(seen, tokens[:len(tokens) - 1]):
                if a != b:
                    break
                keep += 1
            del seen[keep:]
            if self.blocks.has(rid):
                self.blocks.trim(rid, keep)
            # Slots: t[0..L) and the n - 1 drafts fed back (the last draft is never fed).
            if self.blocks.allocate(rid, tokens, len(tokens) + n - 1, use_prefix_cache=False) is None:
                continue
            chunks.append(SequenceChunk(tokens[keep:], keep, self.blocks.block_table(rid), True))
            seen.extend(tokens[keep:])
            active.append((request, n))
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        while chunks:
            logits = self.runner.execute(chunks)
            chunks, still = [], []
            for row, (request, n) in enumerate(active):
                rid = request.request_id
                token, q = self._draw(request, logits[row:row + 1], request.num_tokens + len(drafts[rid]))
                drafts[rid].append(token)
                if q is not None:
                    probs[rid].append(q)
                if len(drafts[rid]) < n:
                    seen = self.seen[rid]
                    chunks.append(SequenceChunk([token], len(seen), self.blocks.block_table(rid), True))
                    seen.append(token)
                    still.append((request, n))
            active = still
        return {rid: Draft(tokens, torch.cat(probs[rid]) if probs[rid] else None)
                for rid, tokens in drafts.items()}

    def _draw(self, request: Request, logits: torch.Tensor, position: int
              ) -> tuple[int, torch.Tensor | None]:
        """The draft token at `position` from the draft's logits [1, V], and the row it was
        drawn from (None for greedy: a point mass)."""
        params = request.sampling_params
        if params.greedy:
            return int(logits[0].argmax()), None
        q = probabilities(apply_logit_bias(logits, [params]), [params])
        if params.seed is not None:
            gen = position_generator(params.seed, -1 - position, q.device)
        else:
            gen = self._generators.get(request.request_id)
            if gen is None:
                gen = self._generators[request.request_id] = make_generator(None, q.device)
        return int(torch.multinomial(q[0], 1, generator=gen)), q

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        length = self.lengths.get(request_id)
        if length is not None:
            length.record(proposed, accepted)

    def forget(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.lengths.pop(request_id, None)
        self._generators.pop(request_id, None)
        self.blocks.free(request_id)
