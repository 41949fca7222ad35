"""Logprobs a step reports: each sampled token's, with the request's top alternatives, and a
prompt's own (prompt_logprobs), both under the raw model distribution (common/logprobs.py)."""

from __future__ import annotations

import torch

from common.logprobs import TokenLogprob
from engine.model_runner import SequenceChunk
from engine.request import Request


def prompt_logit_rows(request: Request, start: int, num_tokens: int) -> range:
    """The indexes into a chunk [start, start + num_tokens) whose logits give prompt logprobs
    not yet computed: positions p < num_prompt_tokens - 1 (position p's distribution scores
    prompt token p + 1; the last prompt position's is the first sample). Empty unless the
    request asked."""
    if request.sampling_params.prompt_logprobs is None:
        return range(0)
    lo = max(start, len(request.prompt_logprobs))
    hi = min(start + num_tokens, request.num_prompt_tokens - 1)
    return range(lo - start, max(lo, hi) - start)


def token_logprobs(requests: list[Request], logits: torch.Tensor,
                   sampled: dict[str, int]) -> dict[str, TokenLogprob]:
    """request id -> its token's logprob, for the requests that asked (and got a token).
    A batch where none asked pays one test per request. The raw model distribution
    (common/logprobs.py): log_softmax of `logits` as the runner returned them, before the
    grammar mask, penalties, filters and temperature, as vLLM reports by default."""
    rows = [(i, r) for i, r in enumerate(requests)
            if r.sampling_params.logprobs is not None and r.request_id in sampled]
    if not rows:
        return {}
    index = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=logits.device)
    logp = torch.log_softmax(logits[index].float(), dim=-1)
    chosen = torch.tensor([sampled[r.request_id] for _, r in rows], dtype=torch.int64,
                          device=logits.device)
    chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    n = min(max(r.sampling_params.logprobs for _, r in rows), logp.shape[1])
    top_lp, top_ids = [[]] * len(rows), [[]] * len(rows)
    if n:  # one topk for the batch, at its largest n; each row keeps its own
        values, ids = logp.topk(n, dim=-1)
        top_lp, top_ids = values.tolist(), ids.tolist()
    out = {}
    for j, (_, r) in enumerate(rows):
        k = r.sampling_params.logprobs
        top = tuple(zip(top_ids[j][:k], top_lp[j][:k]))
        out[r.request_id] = TokenLogprob(sampled[r.request_id], chosen_lp[j], top)
    return out

def add_prompt_logprobs(scheduled, chunks: list[SequenceChunk], rows: torch.Tensor) -> None:
    """Appends to each asking request's prompt_logprobs the entries of its chunk's
    prompt_logits rows (`rows`, in chunk order): the next prompt token's logprob under
    the raw distribution at each position, and the request's top alternatives."""
    logp = torch.log_softmax(rows.float(), dim=-1)
    owners, targets = [], []
    for s, c in zip(scheduled, chunks):
        for i in c.prompt_logits:
            owners.append(s.request)
            targets.append(s.request.token_ids[c.start_pos + i + 1])
    index = torch.tensor(targets, dtype=torch.int64, device=logp.device)
    chosen = logp.gather(1, index[:, None]).squeeze(1).tolist()
    n = min(max(r.sampling_params.prompt_logprobs for r in owners), logp.shape[1])
    top_lp, top_ids = [[]] * len(owners), [[]] * len(owners)
    if n:
        values, ids = logp.topk(n, dim=-1)
        top_lp, top_ids = values.tolist(), ids.tolist()
    for j, request in enumerate(owners):
        k = request.sampling_params.prompt_logprobs
        request.prompt_logprobs.append(
            TokenLogprob(targets[j], chosen[j], tuple(zip(top_ids[j][:k], top_lp[j][:k]))))
