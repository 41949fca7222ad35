"""What a prompt token costs this engine's forward passes, measured on its own passes.

A decode worker may prefill a short prompt itself, in its decode weight format, instead of
having a prefill worker compute it and move its KV (conditional disaggregation). Whether that
pays depends on the two formats' prompt speeds on this host, which differ by model size far
more than a token count can say: on a Sapphire Rapids class core, SmolLM2-135M prefills ~260
tokens/s in int4 (a decode worker) and ~250 in fp32 (its prefill worker), while a 1.07B LLaMA
prefills ~50 in int4 and ~120 in bf16, so 8 short prompts prefilled locally took the 1B's
decode worker ~5 s and every running stream waited with them (`benchmarks.bench_engine`
prompt tok/s; `benchmarks.bench_peer` decode8 TTFT). Each worker therefore reports this
figure in its heartbeats and the coordinator compares them (coordinator/placement.py).

    cost = PrefillCost()
    cost.observe(prompt_tokens, rows, seconds)   # after a pass that computed prompt tokens
    cost.seconds_per_token                       # 0.0 until a pass with enough of them

A pass's seconds are divided by all its rows (prompt tokens and the decode tokens beside them):
the average row's cost, which for a decode worker's mixed pass is what a prompt token adds on
top of the memory-bound decode step, and for a prefill worker what it is. Passes with fewer
than MIN_PROMPT_TOKENS prompt tokens are not counted (a decode step with a 1-token recompute
says nothing about prefill). The figure is an exponential moving average, so it follows the
host (a core lease's threads, another process's load) without jumping at one slow pass.
"""

from __future__ import annotations

MIN_PROMPT_TOKENS = 8
ALPHA = 0.2  # weight of the newest pass
CALIBRATION_TOKENS = 32  # the start-up pass (LLMEngine.calibrate_prefill)


class PrefillCost:
    def __init__(self) -> None:
        self.seconds_per_token = 0.0

    def observe(self, prompt_tokens: int, rows: int, seconds: float) -> None:
        if prompt_tokens < MIN_PROMPT_TOKENS or rows <= 0 or seconds <= 0.0:
            return
        sample = seconds / rows
        self.seconds_per_token = (sample if self.seconds_per_token == 0.0
                                  else (1.0 - ALPHA) * self.seconds_per_token + ALPHA * sample)
