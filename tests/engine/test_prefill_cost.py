"""What a prompt token costs an engine (engine/prefill_cost.py): the moving average, the start-up
calibration pass (LLMEngine.calibrate_prefill), the passes of real requests, and the figure in
a worker's status (worker/node_server.py worker_status), which the coordinator's placement
reads (tests/coordinator/test_placement.py)."""

from __future__ import annotations

import asyncio

import pytest

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.prefill_cost import ALPHA, MIN_PROMPT_TOKENS, PrefillCost
from reliability.model_factory import make_tiny_hf_model
from worker.engine_loop import EngineLoop
from worker.node_server import worker_status


def test_the_average_starts_at_the_first_pass_and_skips_passes_with_few_prompt_tokens():
    cost = PrefillCost()
    cost.observe(MIN_PROMPT_TOKENS - 1, 64, 1.0)  # a decode step with a short recompute
    cost.observe(32, 32, 0.0)
    assert cost.seconds_per_token == 0.0
    cost.observe(32, 40, 0.4)  # 32 prompt tokens beside 8 decodes: 10 ms a row
    assert cost.seconds_per_token == pytest.approx(0.01)
    cost.observe(20, 20, 0.4)  # 20 ms a row, weighted ALPHA
    assert cost.seconds_per_token == pytest.approx((1 - ALPHA) * 0.01 + ALPHA * 0.02)


@pytest.fixture
def engine(tmp_path):
    return LLMEngine.from_path(make_tiny_hf_model(tmp_path / "m", "llama"),
                               EngineConfig(cache=CacheConfig(num_blocks=32)))


def test_calibration_measures_without_taking_or_caching_a_block(engine, tmp_path):
    assert engine.prefill_cost.seconds_per_token == 0.0
    seconds = engine.calibrate_prefill(24)
    assert seconds > 0.0 and engine.prefill_cost.seconds_per_token == seconds
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.cached_hashes()
    # A pool too small for a pass of MIN_PROMPT_TOKENS measures nothing (and runs no pass).
    tiny = LLMEngine.from_path(make_tiny_hf_model(tmp_path / "tiny", "llama"),
                               EngineConfig(cache=CacheConfig(num_blocks=1, block_size=4)))
    assert tiny.calibrate_prefill() == 0.0
    # An engine holding a request's blocks is refused (the pass would write into them).
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, num_predict=4))
    engine.step()
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.calibrate_prefill()


def test_request_passes_feed_the_average_and_the_worker_status_reports_it(engine):
    list(engine.generate(list(range(3, 43)), SamplingParams(temperature=0.0, num_predict=2)))
    measured = engine.prefill_cost.seconds_per_token
    assert measured > 0.0

    async def status():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            loop.call(lambda: None)
            for _ in range(100):  # the snapshot is replaced after each iteration
                if loop.snapshot.prefill_token_seconds:
                    break
                await asyncio.sleep(0.01)
            return worker_status("d1", "decode", loop)
        finally:
            loop.stop()

    assert asyncio.run(status()).prefill_token_seconds == pytest.approx(measured)
