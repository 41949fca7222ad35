"""Grammars never block the engine: a worker compiles a request's grammar on its own grammar
thread before the request reaches the engine thread, so a slow compile delays that request
only; past GRAMMAR_TIMEOUT_S it is refused, and the batch never waited."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.sampling_params import GrammarSpec, SamplingParams
from decode_node.worker import DecodeJob, DecodeWorker
from engine.config import CacheConfig, EngineConfig
from engine.grammar import GrammarBackend
from engine.llm_engine import LLMEngine
from reliability.model_factory import make_tiny_hf_model
from worker import engine_loop

SLOW_COMPILE_S = 1.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "llama")


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_path(model_dir, EngineConfig(
        role="decode", weight_format="fp32", cache=CacheConfig(block_size=16, num_blocks=64)))


@pytest.fixture
def slow_compile(monkeypatch):
    """Every grammar compile takes SLOW_COMPILE_S and records the thread it ran on."""
    threads = []
    real = GrammarBackend.matcher

    def matcher(self, spec, stop_token_ids):
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_COMPILE_S)
        return real(self, spec, stop_token_ids)

    monkeypatch.setattr(GrammarBackend, "matcher", matcher)
    return threads


def _job(engine: LLMEngine, request_id: str, grammar: GrammarSpec | None,
         max_tokens: int) -> DecodeJob:
    # The coordinator sends the vocabulary's stop tokens: a complete grammar ends on them.
    return DecodeJob(request_id, [5, 6, 7], SamplingParams(temperature=0.0, grammar=grammar),
                     engine.tokenizer.stop_token_ids, max_tokens, remote_prefill=False)


async def _drain(stream) -> list:
    events = []
    while not events or not events[-1].finished:
        events.append(await asyncio.wait_for(stream.get(), 60))
    return events


def test_a_compiling_grammar_holds_up_only_its_own_request(model_dir, slow_compile):
    engine = _engine(model_dir)
    steps_during_compile = []

    async def body(loop):
        worker = DecodeWorker(engine, loop)
        worker.start()
        try:
            slow = worker.open(_job(engine, "slow", GrammarSpec("regex", "[a-c]{1,8}"), 8))
            plain = worker.open(_job(engine, "plain", None, 24))
            steps = worker.steps
            plain_events = await _drain(plain)  # finishes while the grammar still compiles
            steps_during_compile.append(worker.steps - steps)
            assert slow.empty()
            return plain_events, await _drain(slow)
        finally:
            worker.stop()

    async def main():
        return await body(asyncio.get_running_loop())

    plain_events, slow_events = asyncio.run(main())
    assert sum(len(e.token_ids) for e in plain_events) == 24
    assert steps_during_compile[0] >= 24  # the engine stepped on through the compile
    assert slow_events[-1].finished and not slow_events[-1].error
    assert slow_compile and all(name.endswith("-grammar_0") for name in slow_compile)
    assert "decode-engine" not in slow_compile
    engine.block_manager.reset_prefix_cache()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_grammar_that_compiles_too_long_is_refused(model_dir, slow_compile, monkeypatch):
    monkeypatch.setattr(engine_loop, "GRAMMAR_TIMEOUT_S", 0.2)
    engine = _engine(model_dir)

    async def main():
        worker = DecodeWorker(engine, asyncio.get_running_loop())
        worker.start()
        try:
            return await _drain(worker.open(_job(engine, "slow", GrammarSpec("regex", "[a-c]+"), 8)))
        finally:
            worker.stop()

    events = asyncio.run(main())
    assert events[-1].finished and "did not compile within 0.2 s" in events[-1].error
    assert not engine.scheduler.requests  # it never reached the engine
