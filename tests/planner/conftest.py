"""A cost profile with round numbers for the planner's tests (no measurement, no files)."""

from __future__ import annotations

import pytest

from planner.cost_profile import CostProfile


def make_profile(**overrides) -> CostProfile:
    fields = dict(prefill_base_s=0.01, prefill_per_token_s=1e-4, prefill_per_pair_s=1e-8,
                  decode_base_s=0.02, decode_per_seq_s=1e-3, decode_per_ctx_token_s=1e-6,
                  kv_bytes_per_token=1000.0, transfer_bytes_per_s=1e7, transfer_latency_s=0.005,
                  coordinator_overhead_s=0.002, block_size=16, source="test")
    fields.update(overrides)
    return CostProfile(**fields)


@pytest.fixture
def profile() -> CostProfile:
    return make_profile()
