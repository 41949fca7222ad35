"""benchmarks.profile_host's served run: a real 1:1 cluster of a tiny model answers chats one
at a time, and what serving adds to the profile's simulation of each becomes the profile's
prefill pass overhead, coordinator delay and decode step overhead."""

from __future__ import annotations

import pytest

from benchmarks.profile_host import SERVED_REQUESTS, measure_serving
from reliability.model_factory import make_tiny_hf_model
from tests.planner.conftest import make_profile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A context long enough for the warm-up's long prompt and the 300-word chats (byte-level
    # tokens: ~2,000 of them).
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama", max_position=8192)


def test_the_served_run_measures_what_serving_adds(model_dir):
    # A profile whose passes cost next to nothing: whatever the served requests took beyond it
    # is serving (tokenization, the gRPC legs, the worker's loop, streaming to the client).
    free = make_profile(prefill_base_s=1e-6, prefill_per_token_s=1e-9, prefill_per_pair_s=0.0,
                        decode_base_s=1e-6, decode_per_seq_s=1e-9, decode_per_ctx_token_s=0.0,
                        transfer_latency_s=0.0, transfer_bytes_per_s=1e15,
                        coordinator_overhead_s=0.0)
    served, side_cpu_s = measure_serving(str(model_dir), free, "fp32", "fp32")
    assert served.requests == SERVED_REQUESTS
    # The workers' threads beside their engines (gRPC, the KV transfer) used some CPU per
    # request: /proc's ticks of 10 ms are coarse, a few per request, never a second.
    assert 0.0 < side_cpu_s < 1.0
    # The prefill worker's pass (its whole reported time, against free passes) and what the
    # coordinator adds around it are apart; both take time on a real cluster.
    assert 0.0 < served.prefill_pass_s < 30.0 and 0.0 < served.coordinator_s < 30.0
    assert 0.0 < served.decode_step_s < 5.0
    # Against a profile that already costs more than any served request took, nothing is
    # left to attribute to serving: the overheads are clamped at 0, never negative.
    slow = make_profile(prefill_base_s=60.0, decode_base_s=10.0, coordinator_overhead_s=0.0)
    none, _ = measure_serving(str(model_dir), slow, "fp32", "fp32")
    assert (none.prefill_pass_s, none.coordinator_s, none.decode_step_s) == (0.0, 0.0, 0.0)


def test_solo_ratios_are_medians_of_measured_over_simulated():
    from benchmarks.bench_modes import Sample
    from benchmarks.validate_plan import solo_ratios
    from planner.metrics import RequestTimes

    def pair(ttft: float, itls: list[float], sim_ttft: float, sim_tpot: float):
        return Sample("short", ttft, itls, len(itls) + 1), RequestTimes(0.0, sim_ttft, sim_ttft + sim_tpot * len(itls),
                                                                        len(itls) + 1)

    pairs = [pair(0.2, [0.01, 0.03], 0.1, 0.01), pair(0.3, [0.02, 0.02], 0.2, 0.02), pair(0.9, [0.05], 0.3, 0.01)]
    ttft, tpot = solo_ratios(pairs)
    assert ttft == pytest.approx(2.0) and tpot == pytest.approx(2.0)  # medians of (2, 1.5, 3) and (2, 1, 5)
    assert solo_ratios([pair(0.1, [0.01], 0.0, 0.0)]) == (float("inf"), float("inf"))
    assert all(v != v for v in solo_ratios([]))  # nan: nothing measured
