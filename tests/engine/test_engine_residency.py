"""LLMEngine.unload_weights / load_weights (keep_alive on a worker): the model object is
freed, the KV pool stays, work is refused meanwhile, and the reloaded model answers alike."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from worker.engine_loop import EngineLoop
from common.errors import ResidencyError
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from reliability.model_factory import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, num_predict=8)


def test_unload_frees_the_model_and_load_restores_it(tmp_path):
    engine = LLMEngine.from_path(make_tiny_hf_model(tmp_path / "m", "llama"), EngineConfig(
        cache=CacheConfig(num_blocks=64)))
    before = list(engine.generate([1, 5, 9, 13], GREEDY))
    model, pool = weakref.ref(engine.model), engine.runner.kv_cache
    engine.unload_weights()
    gc.collect()
    assert model() is None and not engine.resident
    assert engine.runner.kv_cache is pool  # the KV pool (a decode worker's receiver buffer) stays
    with pytest.raises(ResidencyError):
        engine.require_resident()
    assert engine.load_weights() > 0 and engine.resident
    assert engine.load_weights() == 0.0
    assert list(engine.generate([1, 5, 9, 13], GREEDY)) == before


def test_unload_is_refused_while_requests_are_open(tmp_path):
    engine = LLMEngine.from_path(make_tiny_hf_model(tmp_path / "m", "llama"), EngineConfig(
        cache=CacheConfig(num_blocks=64)))
    engine.add_request([1, 5, 9], GREEDY)
    with pytest.raises(ResidencyError):
        engine.unload_weights()
    assert engine.resident


def test_engine_loop_set_resident_runs_between_steps(tmp_path):
    engine = LLMEngine.from_path(make_tiny_hf_model(tmp_path / "m", "llama"), EngineConfig(
        cache=CacheConfig(num_blocks=64)))

    async def scenario():
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            assert await loop.set_resident(False) == 0.0
            await asyncio.sleep(0.05)
            assert loop.snapshot.resident is False
            assert await loop.set_resident(True) > 0
        finally:
            loop.stop()
        assert engine.resident

    asyncio.run(asyncio.wait_for(scenario(), 60))
