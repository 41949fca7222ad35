"""An engine on its own thread, so that a worker's asyncio loop (gRPC, heartbeats, KV
transfers) never waits behind a forward pass.

Threading contract:
- Everything that touches the engine (scheduler, block manager, runner) runs on the engine
  thread. Other threads hand it work with `call(fn)`; `fn` runs between two steps, in order.
- The engine thread hands results back with `post(fn, *args)`, which schedules `fn` on the
  asyncio loop given at construction; nothing on the engine thread touches asyncio objects.
- Each iteration: run queued calls, `poll()` (subclasses: transfers), one `engine.step()` if
  any request has work, `on_outputs(...)`. With nothing to do, or when the last step could
  schedule nothing (the pool is full until transfers finish), it sleeps on the call queue for
  at most `idle_wait_s`: polling continues, and the GIL is left to the transfer threads.
- `cores` (worker/core_share.py, None without a core lease): `before_step()` before every
  step that has something to compute, `after_work()` whenever the engine has nothing it can
  run, both on this thread.
- `snapshot` is a LoadSnapshot of plain ints, replaced (never mutated) by the engine thread
  after every iteration; other threads read it for heartbeats instead of touching the
  scheduler's queues, which the engine thread mutates.
- Grammars compile on the loop's own grammar thread (`grammar_for`), before a request is
  handed to the engine thread, within GRAMMAR_TIMEOUT_S: a large schema delays only its own
  request, never a step of the batch.
- `set_resident` drops or reloads the engine's weights through `call` (keep_alive,
  coordinator/residency.py); while they are dropped the workers refuse new requests.
- If the loop dies, `alive` turns False, open requests are failed (`on_fatal`) and new ones
  are refused at once (`check_alive`); the process is expected to exit (node_server watches).
  That is the last resort, for faults of the engine itself (a forward pass that raises). A
  fault in one request's data never gets here: admission refuses bad input (ValueError,
  TandemError), and a request whose sampling fails comes out of `engine.step()` as a finished
  StepOutput with `error` set, while the rest of the batch goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from common.sampling_params import SamplingParams
from engine.grammar import GrammarError
from engine.llm_engine import LLMEngine
from engine.step_output import StepOutput
from engine.request_grammar import RequestGrammar
from engine.speculative import SpecDecodeStats

log = logging.getLogger(__name__)

# The longest a request waits for its grammar to compile (past the size limit of
# common/sampling_params.py, a compile takes well under a second); then it is refused.
GRAMMAR_TIMEOUT_S = 10.0
HASHES_REFRESH_S = 0.25  # at most this often the engine thread copies the prefix cache's hashes


@dataclass(frozen=True)
class LoadSnapshot:
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens not yet computed, waiting or mid-prefill
    cache_version: int = -1  # BlockManager.cache_version when cached_hashes was copied
    cached_hashes: tuple[bytes, ...] = ()  # the prefix cache's block hashes (routing)
    resident: bool = True  # the engine holds its weights (LLMEngine.resident)
    hashes_at: float = 0.0  # time.monotonic() of the cached_hashes copy
    # Speculative decoding's counters (SpecDecodeStats, copied), None when the engine does not
    # speculate.
    spec_decode: SpecDecodeStats | None = None
    prefill_token_seconds: float = 0.0  # engine/prefill_cost.py; 0 while unknown

    @classmethod
    def of(cls, engine: LLMEngine, previous: "LoadSnapshot | None" = None) -> "LoadSnapshot":
        sched, bm = engine.scheduler, engine.block_manager
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(r.num_tokens - r.num_computed_tokens for r in sched.running if r.num_output_tokens == 0)
        now = time.monotonic()
        if previous is not None and (previous.cache_version == bm.cache_version
                                     or now - previous.hashes_at < HASHES_REFRESH_S):
            # Unchanged, or copied moments ago: a decode batch registers a block every few
            # steps, and heartbeats (about 1 s apart) need no fresher copy than this.
            version, hashes, at = previous.cache_version, previous.cached_hashes, previous.hashes_at
        else:
            version, hashes, at = bm.cache_version, tuple(bm.cached_hashes()), now
        spec = engine.spec_stats
        return cls(bm.num_blocks, bm.num_free_blocks, len(sched.running), len(sched.waiting), queued,
                   version, hashes, engine.resident, at,
                   None if spec is None else replace(spec), engine.prefill_cost.seconds_per_token)


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, name: str = "engine",
                 idle_wait_s: float = 0.002) -> None:
        self.engine = engine
        self.loop = loop
        self.idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.snapshot = LoadSnapshot.of(engine)
        self.fatal: BaseException | None = None
        self.cores = None  # a CoreShare, set before start() (worker/core_share.py)
        # One thread: compiles queue behind each other, never beside the engine's own thread's
        # work for more than one core's worth; created at the first grammar.
        self._grammar_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- any thread ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self._calls.put(lambda: None)
        self._thread.join(timeout_s)
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def grammar_for(self, params: SamplingParams,
                          stop_token_ids: frozenset[int]) -> RequestGrammar | None:
        """The request's grammar matcher (engine/grammar.py), compiled on the grammar thread
        (asyncio side; never the engine thread); None for a request without a grammar.
        GrammarError when it does not compile, or not within GRAMMAR_TIMEOUT_S (the compile
        runs on, and its result is cached for the next request with that grammar)."""
        if params.grammar is None:
            return None
        if self._grammar_pool is None:
            self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"{self._thread.name}-grammar")
        work = self._grammar_pool.submit(self.engine.grammars.matcher, params.grammar,
                                         stop_token_ids)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(work), GRAMMAR_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise GrammarError(f"the {params.grammar.kind} grammar did not compile within "
                               f"{GRAMMAR_TIMEOUT_S:g} s") from None

    def call(self, fn: Callable[[], None]) -> None:
        self._calls.put(fn)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(f"engine loop is not running: {self.fatal or 'stopped'}")

    async def set_resident(self, resident: bool) -> float:
        """Drops (False) or loads (True) the engine's weights on the engine thread, between two
        steps; returns the seconds spent loading. ResidencyError when dropping them while
        requests are open. Loading blocks the engine thread, which has no work then anyway:
        while unloaded every new request is refused."""
        self.check_alive()
        done: asyncio.Future = self.loop.create_future()

        def run() -> None:
            try:
                if resident:
                    seconds = self.engine.load_weights()
                else:
                    self.engine.unload_weights()
                    seconds = 0.0
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting call
                self.post(settle, done, None, exc)
            else:
                self.post(settle, done, seconds, None)

        self.call(run)
        return await done

    # -- engine thread -------------------------------------------------------------------

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the process is shutting down
            pass

    def poll(self) -> None:
        """Per-iteration hook for subclasses (KV transfer progress)."""

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        """Per-step hook for subclasses: deliver what the step produced."""

    def on_fatal(self, exc: BaseException) -> None:
        """The loop died on an internal error; subclasses fail every open request."""

    def _drain(self, block: bool) -> None:
        try:
            fn = self._calls.get(timeout=self.idle_wait_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while True:
            fn()
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        stalled = False  # the last step had work but could schedule none of it
        try:
            while not self._stopping.is_set():
                self._drain(block=stalled or not self.engine.has_work())
                self.poll()
                stalled = False
                if self.engine.has_work():
                    # Only a step that computes: one that only reports transfers holds no core.
                    if self.cores is not None and self.engine.scheduler.has_schedulable():
                        self.cores.before_step()
                    outputs = self.engine.step()
                    self.steps += 1
                    stalled = not self.engine.last_step_ran and not outputs
                    if outputs:
                        self.on_outputs(outputs)
                if self.cores is not None and (stalled or not self.engine.scheduler.has_schedulable()):
                    self.cores.after_work()
                self.snapshot = LoadSnapshot.of(self.engine, self.snapshot)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            log.exception("engine loop died")
            self.fatal = exc
            self.on_fatal(exc)


def settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    """Resolve `future` (on its loop's thread) unless its caller gave up."""
    if future.done():  # the caller gave up (cancelled)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
