"""Adaptive draft length, per request, for every proposer (engine/proposer.py). Torch-free.

An exponential moving average of accepted / proposed draft tokens scales k. A draft of L tokens
is expected to emit 1 + acceptance * L tokens in its step; it is made only when that beats
`cost_ratio`, what a step with drafts costs over a plain one as the engine measured it
(SpeculativeDecoder: wider passes, a draft model's own passes, and on the CPU the loss of the
fused native decode call, which takes one-token decodes only). Otherwise the request only
probes with one token every PROBE_INTERVAL steps, or less often where a drafted step costs
much more than a plain one (probe_interval).

Only greedy requests are gated by cost: their output is the same whatever is drafted, while a
sampled request's tokens depend on which were drafted (rejection sampling draws differently
from a plain step), so its drafts must follow from its own history alone (its acceptance), not
from timings, for a seed to give the same answer every run. So a workload the proposer cannot predict (nothing to copy for prompt
lookup, a draft model that disagrees with the target) runs nearly as plain decoding, and one
that becomes predictable later is still found. A draft model's tokens each cost a pass of it,
so there the saving is the draft passes themselves, not only the verification's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EMA_WEIGHT = 0.3  # weight of the newest step's acceptance ratio in the moving average
PROBE_INTERVAL = 8  # steps between one-token probes once the average drafts nothing
PROBE_OVERHEAD = 0.03  # what probing may add to a gated request's decode time, at most


def probe_interval(cost_ratio: float) -> int:
    """Steps between probes: PROBE_INTERVAL, or more where a drafted step costs so much more
    than a plain one that probing that often would cost more than PROBE_OVERHEAD (a probe
    costs cost_ratio - 1 plain steps; on the CPU, ~1.1 of them)."""
    return max(PROBE_INTERVAL, math.ceil((cost_ratio - 1.0) / PROBE_OVERHEAD - 1e-9))


@dataclass
class DraftLength:
    acceptance: float = 1.0  # moving average of accepted / proposed; optimistic at first
    idle_steps: int = 0  # steps since the last probe while the average drafts nothing

    def draft_length(self, k: int, cost_ratio: float = 1.0) -> int:
        """Tokens to draft this step: k scaled by the acceptance average, when that is
        expected to pay for the step's extra cost (cost_ratio: 1.0 for a sampled request,
        module docstring); else 0, except for a one-token probe every PROBE_INTERVAL steps."""
        length = min(k, int(self.acceptance * k + 0.5))
        if length and 1.0 + self.acceptance * length > cost_ratio:
            return length
        self.idle_steps += 1
        if self.idle_steps >= probe_interval(cost_ratio):
            self.idle_steps = 0
            return 1
        return 0

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.acceptance += EMA_WEIGHT * (accepted / proposed - self.acceptance)
