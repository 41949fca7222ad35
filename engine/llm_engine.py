"""One engine: scheduler + model runner + sampler, driven as schedule -> execute -> update.

This is the single-process engine behind `tandem run` and the colocated worker; the prefill
and decode workers wrap the same engine with a role (EngineConfig.role). The role fixes which
weight formats the model holds (engine.config.role_formats): a prefill engine only its
prefill format, a decode engine only its decode format (every pass, local prefill chunks
included), a colocated engine its decode format plus, when distinct, a prefill copy for
passes without decode tokens (engine/models/llama.py).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from common.errors import ContextLengthError, InvalidOptionError, ResidencyError, SamplingError
from common.malloc_policy import loading_weights
from common.pooling import Pooling
from common.request_id import log_extra
from common.sampling_params import SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.device import resolve_device
from engine.draft_loading import load_draft
from engine.draft_proposer import DraftModelProposer, check_same_vocabulary
from engine.embedding import pool_step, pooled_vector
from engine.format_choice import AUTO_FORMAT, choose_on_this_host
from engine.grammar import GrammarBackend
from engine.kv_cache_sizing import KV_TORCH_DTYPES, kv_dtype_name, sized_cache
from engine.kv_connector import ConnectorEvents, KVConnector
from engine.model_runner import ModelRunner, SequenceChunk
from engine.models import model_class
from engine.pass_record import PassRecord
from engine.prefill_cost import CALIBRATION_TOKENS, MIN_PROMPT_TOKENS, PrefillCost
from engine.request import Request, RequestStatus
from engine.sampler import NO_TOKEN, Sampler, forbid_tokens, make_generator, position_generator
from engine.scheduler import Scheduler
from engine.speculative import SpecDecodeStats, SpeculativeDecoder, seeded_row_generators
from engine.step_logprobs import add_prompt_logprobs, prompt_logit_rows, token_logprobs
from engine.step_output import StepOutput
from kernels import batch_invariance

log = logging.getLogger(__name__)


def _record_pass(plan, started_ns: int) -> None:
    """A PassRecord on each traced request of the pass (Request.passes set by the worker)."""
    traced = [c for c in plan.chunks if c.request.passes is not None]
    if not traced:
        return
    ended_ns = time.time_ns()
    size, total = len(plan.chunks), plan.num_batched_tokens
    for c in traced:
        c.request.passes.append(PassRecord(started_ns, ended_ns, c.num_scheduled_tokens, size,
                                           total, c.start_pos >= c.request.num_prompt_tokens))


class LLMEngine:
    def __init__(self, model, config: EngineConfig, tokenizer=None,
                 kv_dtype: str | torch.dtype | None = None, kv_cache: torch.Tensor | None = None,
                 tokenizer_path: str | Path | None = None, draft_model=None) -> None:
        """`config` with its model and cache.num_blocks known (from_path fills them). The KV
        cache's element type is config.cache.kv_dtype; `kv_dtype` (optional) must agree with
        it, and so must a caller-provided `kv_cache` tensor. The cache lives on the model's
        device; config.cuda_graphs: replay decode steps as CUDA graphs there. draft_model:
        the proposer's model when config.speculative's method is "draft" (from_path loads it;
        ValueError when it is missing or its vocabulary is not the target's)."""
        want = config.cache.kv_dtype
        if kv_dtype is not None and kv_dtype_name(kv_dtype) != want:
            raise ValueError(f"kv_dtype {kv_dtype_name(kv_dtype)!r} contradicts the engine config's "
                             f"cache.kv_dtype {want!r}")
        if kv_cache is not None and kv_cache.dtype != KV_TORCH_DTYPES[want]:
            raise ValueError(f"the provided kv_cache holds {kv_cache.dtype}, but the engine's KV "
                             f"dtype is {want} ({KV_TORCH_DTYPES[want]})")
        if config.model is None or config.cache.num_blocks is None:
            raise ValueError(f"LLMEngine needs a config with its model and cache.num_blocks known "
                             f"(LLMEngine.from_path reads them), got model={config.model!r}, "
                             f"num_blocks={config.cache.num_blocks!r}")
        if config.role != "colocated" and getattr(model, "prefill_copy", None) is not None:
            raise ValueError(f"a {config.role} engine runs every pass in one weight format, but the "
                             f"model holds {model.formats}")
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(config.cache.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = ModelRunner(model, config.cache, KV_TORCH_DTYPES[want], kv_cache,
                                  config.cuda_graphs)
        # The KV connector of a worker that transfers KV (engine/kv_connector.py); None for
        # an engine that never does (colocated, `tandem run`).
        self.connector: KVConnector | None = None
        self.sampler = Sampler()
        # Speculative decoding (engine/speculative.py), when the config asks for it.
        self.speculator: SpeculativeDecoder | None = None
        if config.speculative is not None:
            proposer = None
            if config.speculative.method == "draft":
                if draft_model is None:
                    raise ValueError(f"--speculative {config.speculative.spec}: the draft model "
                                     f"is not loaded (LLMEngine.from_path loads it)")
                check_same_vocabulary(config.model.vocab_size, draft_model.config.vocab_size)
                proposer = DraftModelProposer(draft_model, config.speculative.num_speculative_tokens,
                                              config.cache, KV_TORCH_DTYPES[want])
            elif draft_model is not None:
                raise ValueError(f"a draft model was given, but speculative method is "
                                 f"{config.speculative.method!r}")
            self.speculator = SpeculativeDecoder(config.speculative, self.sampler, proposer)
        # Structured output (engine/grammar.py): llguidance's vocabulary is built at the first
        # grammar request, from `tokenizer` or else from tokenizer_path (workers load none).
        self.grammars = GrammarBackend(config.model.vocab_size, tokenizer, tokenizer_path)
        self._generators: dict[str, torch.Generator] = {}
        # Embedding requests: request id -> the fp64 sum of its computed prompt positions' final
        # hidden states so far (reset when a preemption recomputes it from the start).
        self._pooled: dict[str, torch.Tensor] = {}
        self._ids = itertools.count()
        self._pending: list[StepOutput] = []
        self.load_duration_s = 0.0
        self.last_step_ran = False  # whether the last step() ran a forward pass
        self._reload_model = None  # from_path: rebuilds the model for load_weights
        # What a prompt token costs this engine's passes (engine/prefill_cost.py), reported in
        # a worker's heartbeats for the coordinator's local-or-remote prefill choice.
        self.prefill_cost = PrefillCost()

    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None, *,
                  kv_cache: torch.Tensor | None = None, load_tokenizer: bool = True) -> "LLMEngine":
        """The engine `config` describes (default: EngineConfig()), with the model read from
        `path`: config.model must be None, and cache.num_blocks None is sized from
        cache.kv_cache_bytes. config.weight_format (and a colocated engine's
        prefill_weight_format) are the formats the model packs; EngineConfig.for_role picks
        them from a user's decode and prefill formats. The device is resolved before the
        model loads. kv_cache: a tensor the caller allocated (a decode worker's receiver
        buffer), of config.cache's shape and dtype."""
        from engine.loaders import load_model
        from common.tokenizer import Tokenizer

        config = config or EngineConfig()
        if config.model is not None:
            raise ValueError("from_path reads the model's config from its files: pass an "
                             "EngineConfig with model=None")
        main_format, second_format = config.weight_format, config.prefill_weight_format
        if second_format is not None and batch_invariance.enabled():
            # A pass runs in the prefill copy only when it holds no decode token, so a prompt's
            # format would depend on what shares its passes: one copy, the decode format's.
            log.info("batch-invariant mode: every pass in %s (no %s prefill copy)", main_format,
                     second_format)
            second_format = None
        target = resolve_device(config.device).torch_device
        t0 = time.monotonic()
        with loading_weights():  # peak: the model plus one matrix's temporaries
            loaded = load_model(Path(path))
            prompt_head = None  # the prompt-pass copy's lm_head format, where auto picks one
            if AUTO_FORMAT in (main_format, second_format):
                choice = choose_on_this_host(loaded.config, loaded.weights, target.type)
                log.log(logging.INFO if choice.fits else logging.WARNING,
                        "prefill weight format auto: %s (%s)", choice.format, choice.reason)
                prompt_head = choice.prompt_head
                main_format = choice.format if main_format == AUTO_FORMAT else main_format
                second_format = choice.format if second_format == AUTO_FORMAT else second_format
                if second_format == main_format:
                    second_format = None  # a colocated engine whose prefill format is its decode one
            model = model_class(loaded.config.architecture)(loaded.config, loaded.weights, main_format,
                                                            prefill_format=second_format, device=target,
                                                            prompt_only=config.role == "prefill",
                                                            prompt_head_format=prompt_head)
            model_config = loaded.config
            loaded.drop_resident_pages()
            del loaded  # the file's mapping, and the loader's own copies, go before the trim
        config = replace(config, model=model_config, cache=sized_cache(config.cache, model_config),
                         weight_format=main_format, prefill_weight_format=second_format)
        tokenizer = Tokenizer.from_path(Path(path)) if load_tokenizer else None
        draft = None
        if config.speculative is not None and config.speculative.method == "draft":
            draft = load_draft(config.speculative.draft_model, Path(path), model_config,
                                main_format, target)
        engine = cls(model, config, tokenizer, kv_cache=kv_cache, tokenizer_path=path,
                     draft_model=draft)
        engine.load_duration_s = time.monotonic() - t0

        def reload():  # the same path and formats, for load_weights after unload_weights
            with loading_weights():
                again = load_model(Path(path))
                rebuilt = model_class(again.config.architecture)(again.config, again.weights, main_format,
                                                                 prefill_format=second_format, device=target,
                                                                 prompt_only=config.role == "prefill",
                                                                 prompt_head_format=prompt_head)
                again.drop_resident_pages()
                return rebuilt

        engine._reload_model = reload
        return engine

    # -- residency (keep_alive): called on the engine thread, between steps ---------------

    @property
    def resident(self) -> bool:
        """Whether the weights are loaded (unload_weights drops them)."""
        return self.model is not None

    def unload_weights(self) -> None:
        """Drops the model (its weights) while keeping the scheduler, block manager and KV
        pool: a decode worker's pool is the KV receiver's buffer (shared memory for shm),
        whose layout peers handshook, and the prefix cache stays valid for the same weights.
        ResidencyError while requests are open."""
        if self.has_unfinished():
            raise ResidencyError("cannot unload the model while requests are open")
        if self.model is None:
            return
        self.model = None
        self.runner.model = None
        if self.runner.graphs is not None:  # captured graphs hold the weights too
            self.runner.graphs.release()
        gc.collect()

    def load_weights(self) -> float:
        """Loads the weights again from the path from_path read; returns the seconds it took
        (0.0 when they were loaded)."""
        if self.model is not None:
            return 0.0
        if self._reload_model is None:
            raise ResidencyError("this engine was not built from a path; it cannot reload its model")
        t0 = time.monotonic()
        self.model = self.runner.model = self._reload_model()
        return time.monotonic() - t0

    def require_resident(self) -> None:
        if self.model is None:
            raise ResidencyError("the model is unloaded (keep_alive expired); load it first")

    # -- requests ------------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        """The model's context, capped by what the KV pool can hold for one request: a
        request that could never fit would otherwise wait (or preempt itself) forever."""
        cache = self.config.cache
        return min(self.config.context_length, cache.num_blocks * cache.block_size)

    def calibrate_prefill(self, tokens: int = CALIBRATION_TOKENS) -> float:
        """Time one prompt pass of `tokens` tokens (after an untimed one, which pays the first
        call's one-time costs) and record it in prefill_cost: a worker's first heartbeat then
        tells the coordinator what its prompt tokens cost before any request has shown it.
        The passes write KV into the first blocks of the pool, which must all be free (a
        worker calls this before it takes requests); no block is taken or cached. Returns the
        seconds per token."""
        if self.block_manager.num_free_blocks != self.block_manager.num_blocks:
            raise RuntimeError("calibrate_prefill needs an idle engine (every KV block free)")
        bs = self.config.cache.block_size
        tokens = min(tokens, self.block_manager.num_blocks * bs, self.context_length - 1)
        if tokens < MIN_PROMPT_TOKENS:  # a pool or context too small to say anything
            return self.prefill_cost.seconds_per_token
        table = list(range(-(-tokens // bs)))
        ids = [(7 * i + 1) % self.config.model.vocab_size for i in range(tokens)]
        with torch.inference_mode():
            self.runner.execute([SequenceChunk(ids[:min(tokens, 8)], 0, table, True, is_decode=False)])
            started = time.perf_counter()
            self.runner.execute([SequenceChunk(ids, 0, table, True, is_decode=False)])
            self.prefill_cost.observe(tokens, tokens, time.perf_counter() - started)
        return self.prefill_cost.seconds_per_token

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None,
                    stop_token_ids: frozenset[int] | None = None,
                    max_tokens: int | None = None, max_chunk_tokens: int = 0) -> Request:
        """Queues a request. Raises ContextLengthError when the prompt leaves no room for a
        single generated token in the context window (num_ctx when given, capped by the
        model's)."""
        return self.submit(self.make_request(prompt_token_ids, params, request_id, stop_token_ids,
                                             max_tokens, max_chunk_tokens))

    def submit(self, request: Request) -> Request:
        """Queues a request built by make_request."""
        if request.max_tokens <= 0:
            request.status = RequestStatus.FINISHED_LENGTH
            self._pending.append(StepOutput(request.request_id, [], True, request.status))
            return request
        if not request.pooling:
            self._generators[request.request_id] = make_generator(request.sampling_params.seed)
        self.scheduler.add_request(request)
        return request

    def make_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str | None = None, stop_token_ids: frozenset[int] | None = None,
                     max_tokens: int | None = None, max_chunk_tokens: int = 0,
                     num_prior_output_tokens: int = 0) -> Request:
        """A validated request, not yet queued. max_tokens (when given) further caps what the
        context and num_predict allow."""
        context = min(params.num_ctx or self.context_length, self.context_length)
        if not prompt_token_ids:
            raise ContextLengthError("the prompt is empty")
        vocab = self.config.model.vocab_size
        ids = [*prompt_token_ids, *(t for t, _ in params.logit_bias)]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidOptionError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_token_ids) >= context:
            raise ContextLengthError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context window of "
                f"{context} tokens")
        if stop_token_ids is None:
            stop_token_ids = self.tokenizer.stop_token_ids if self.tokenizer is not None else frozenset()
        allowed = params.max_tokens_for(len(prompt_token_ids), context)
        return Request(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            max_tokens=allowed if max_tokens is None else min(allowed, max_tokens),
            stop_token_ids=frozenset(stop_token_ids),
            max_chunk_tokens=max(0, max_chunk_tokens),
            num_prior_output_tokens=num_prior_output_tokens,
        )

    def make_embedding_request(self, prompt_token_ids: Sequence[int], normalize: bool = True,
                               request_id: str | None = None,
                               pooling: Pooling = Pooling.MEAN) -> Request:
        """A validated embedding request (pooling), not yet queued: 1 to context_length
        tokens, each in the vocabulary. ContextLengthError / InvalidOptionError else."""
        if not prompt_token_ids or len(prompt_token_ids) > self.context_length:
            raise ContextLengthError(f"an embedding input has {len(prompt_token_ids)} tokens; each "
                                     f"needs 1 to {self.context_length}")
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidOptionError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return Request(request_id=request_id or f"embed-{next(self._ids)}",
                       prompt_token_ids=list(prompt_token_ids),
                       sampling_params=SamplingParams(temperature=0.0), max_tokens=1,
                       pooling=pooling, normalize=normalize)

    def set_connector(self, connector: KVConnector) -> None:
        """Makes this engine take part in KV transfers through `connector` (once, before the
        first request)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("set_connector after requests were added")
        self.connector = connector
        self.scheduler.connector = connector

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends a request in any state; its blocks are freed now or, if a transfer may still
        touch them, once the connector reports them released."""
        self.scheduler.finish_request(request_id, status)
        self._forget(request_id)
        self._pooled.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        """Drops a finished request's per-request sampling state."""
        self._generators.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters; None when this engine does not speculate."""
        return self.speculator.stats if self.speculator is not None else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def has_work(self) -> bool:
        """A step now would compute or report something."""
        return (self.scheduler.has_schedulable() or bool(self._pending)
                or self.scheduler.has_transfers())

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        if self.connector is not None:
            outputs.extend(self._apply_transfers(self.connector.get_finished()))
        step_started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.last_step_ran = not plan.is_empty
        if plan.is_empty:
            return outputs
        # A chunk at or past the first generated token is a decode (ForwardBatch.has_decode);
        # a prompt chunk (first prefill, or a recompute after preemption from inside the
        # prompt) is not. A chunk with drafts computes them after its token, with a logit row
        # for each (engine/speculative.py).
        chunks = [SequenceChunk([*c.request.token_ids[c.start_pos:c.start_pos + c.num_tokens],
                                 *c.draft_token_ids],
                                c.start_pos, self.block_manager.block_table(c.request_id), c.samples,
                                num_logits=1 + len(c.draft_token_ids),
                                is_decode=c.start_pos >= c.request.num_prompt_tokens,
                                prompt_logits=prompt_logit_rows(c.request, c.start_pos, c.num_tokens),
                                pool_hidden=c.request.pooling)
                  for c in plan.chunks]
        for request_id in plan.preempted:  # recomputed from its first token
            self._pooled.pop(request_id, None)
        save_kv_layer = self.connector.bind_pass(plan) if self.connector is not None else None
        pooled: dict[int, torch.Tensor] | None = {} if any(c.pool_hidden for c in chunks) else None
        started_ns = time.time_ns()
        started = time.perf_counter()
        logits = self.runner.execute(chunks, save_kv_layer, pooled)
        self.prefill_cost.observe(sum(len(c.token_ids) for c in chunks if not c.decodes),
                                  sum(len(c.token_ids) for c in chunks), time.perf_counter() - started)
        for index, state in (pooled or {}).items():
            request = plan.chunks[index].request
            self._pooled[request.request_id] = pool_step(request.pooling,
                                                         self._pooled.get(request.request_id), state)
        sampling_chunks = [c for c in plan.chunks if c.samples]
        num_rows = sum(1 + len(c.draft_token_ids) for c in sampling_chunks)
        if logits.shape[0] > num_rows:  # prompt logprob rows follow the sampling rows
            add_prompt_logprobs(plan.chunks, chunks, logits[num_rows:])
            logits = logits[:num_rows]
        logits, runs, spec_failed = self._verify_drafts(sampling_chunks, logits)
        sampling = [c.request for c in sampling_chunks if not c.draft_token_ids]
        sampled, failed = self._sample(sampling, logits)
        failed.update(spec_failed)
        logprobs = token_logprobs(sampling, logits, sampled)
        lengths = {c.request_id: c.request.num_tokens for c in sampling_chunks}
        ended = self.scheduler.update_from_output(plan, {**sampled, **runs})
        finished = {r.request_id for r in ended}
        outputs.extend(self._embedding(r) for r in ended if r.pooling)
        by_id = {c.request_id: c.request for c in plan.chunks}
        for request_id, token in [*sampled.items(), *runs.items()]:
            done = request_id in finished
            if done:
                self._forget(request_id)
            request = by_id[request_id]
            if request_id in runs:
                # What update_from_output appended: the run up to a stop. (A request aborted
                # while the pass ran has no run: _verify_drafts skips it.)
                new_tokens = request.token_ids[lengths[request_id]:]
                self.speculator.record_emitted(len(new_tokens))
            else:
                new_tokens = [token]
            entry = logprobs.get(request_id)
            prompt = (request.prompt_logprobs if request.sampling_params.prompt_logprobs is not None
                      and request.num_output_tokens == 1 else None)
            outputs.append(StepOutput(request_id, new_tokens, done, request.status, request.num_cached_tokens,
                                      logprobs=None if entry is None else [entry],
                                      prompt_logprobs=prompt))
        for request_id, reason in failed.items():
            if request_id not in self.scheduler.requests:
                continue  # aborted while the pass ran
            # Its KV is sound (only the draw failed), but nothing will extend it: free it now.
            self.abort_request(request_id, RequestStatus.FINISHED_ERROR)
            outputs.append(StepOutput(request_id, [], True, RequestStatus.FINISHED_ERROR,
                                      by_id[request_id].num_cached_tokens, error=reason))
        _record_pass(plan, started_ns)
        if self.speculator is not None and all(c.decodes for c in chunks):
            # What speculation costs here, measured (engine/draft_length.py's gate).
            self.speculator.observe_step(time.perf_counter() - step_started,
                                         any(c.draft_token_ids for c in plan.chunks),
                                         len(plan.chunks))
        return outputs

    def _verify_drafts(self, chunks: list, logits: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, list[int]], dict[str, str]]:
        """Splits the sampling rows (in chunk order, 1 + drafts rows per chunk): returns the
        rows of chunks without drafts, each drafted request's verified run, and the drafted
        requests that got no token (their first row had no valid distribution)."""
        if not any(c.draft_token_ids for c in chunks):
            return logits, {}, {}
        plain, runs, failed = [], {}, {}
        row = 0
        for c in chunks:
            width = 1 + len(c.draft_token_ids)
            if not c.draft_token_ids:
                plain.append(row)
            elif c.request_id not in self.scheduler.requests:
                pass  # aborted while the pass ran: nothing to verify, its blocks are free
            else:
                request = c.request
                seed = request.sampling_params.seed
                generators = (seeded_row_generators(seed, request.num_tokens) if seed is not None
                              else lambda i, g=self._generators[request.request_id]: g)
                try:
                    run = self.speculator.verify(request, c.draft_token_ids,
                                                 logits[row:row + width], generators)
                except Exception as exc:  # noqa: BLE001 - this request ends with the error
                    log.exception("verifying the draft of %s failed", request.request_id,
                                  extra=log_extra(request.log_id))
                    run, why = [], f"sampling failed: {type(exc).__name__}: {exc}"
                else:
                    why = ("sampling failed: this request's options leave no finite "
                           "probabilities to draw from (check temperature and the penalties)")
                if run:
                    runs[request.request_id] = run
                else:
                    failed[request.request_id] = why
            row += width
        index = torch.tensor(plain, dtype=torch.int64, device=logits.device)
        return logits[index], runs, failed

    def _embedding(self, request: Request) -> StepOutput:
        """The finish of an embedding request whose whole prompt is computed."""
        vector = pooled_vector(request.pooling, self._pooled.pop(request.request_id),
                               request.num_prompt_tokens, request.normalize)
        return StepOutput(request.request_id, [], True, request.status, embedding=vector)

    def _apply_transfers(self, events: ConnectorEvents) -> list[StepOutput]:
        """Requests that the connector's report ended: a received request whose first token
        already ends it, or a failed transfer. A received request that goes on emits nothing
        here: its first token was the prefill worker's to report."""
        if not events:
            return []
        outputs = []
        for request, error in self.scheduler.update_from_connector(events):
            self._generators.pop(request.request_id, None)
            outputs.append(StepOutput(request.request_id, [], True, request.status,
                                      request.num_cached_tokens, error=error))
        return outputs

    def _sample(self, requests: list[Request], logits: torch.Tensor
                ) -> tuple[dict[str, int], dict[str, str]]:
        """(request id -> token, request id -> why it got none). One request's values never
        fail the others: the sampler reports a row with no valid distribution, and should it
        raise anyway, each row is retried alone so that only the rows that raise fail."""
        if not requests:
            return {}, {}
        failed: dict[str, str] = {}
        try:
            tokens = self._sample_rows(requests, logits).tolist()
        except Exception:  # noqa: BLE001 - narrowed to the rows at fault just below
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(requests))
            tokens = []
            for i, request in enumerate(requests):
                try:
                    tokens.append(int(self._sample_rows([request], logits[i:i + 1])[0]))
                except Exception as exc:  # noqa: BLE001 - this request ends with the error
                    failed[request.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
                    log.warning("request %s: %s", request.request_id, failed[request.request_id],
                                extra=log_extra(request.log_id))
                    tokens.append(NO_TOKEN)
        sampled = {}
        for request, token in zip(requests, tokens):
            if token != NO_TOKEN:
                sampled[request.request_id] = token
            else:
                failed.setdefault(request.request_id, (
                    "sampling failed: this request's options leave no finite probabilities to "
                    "draw from (check temperature and the penalties)"))
        return sampled, failed

    def _sample_rows(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        # -- structured output: rows with a grammar get its token mask (engine/grammar.py); a
        # batch without one pays this test only.
        if any(r.sampling_params.grammar is not None for r in requests):
            logits = self.grammars.mask(requests, logits)
        # -- min_tokens: no stop token until the request has that many, earlier placements'
        # tokens included (they ended no request).
        logits = forbid_tokens(logits, [
            r.stop_token_ids if r.num_output_tokens + r.num_prior_output_tokens
            < r.sampling_params.min_tokens else () for r in requests])
        # --
        return self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            [r.token_ids for r in requests],
            [self._generator_for(r) for r in requests],
        )

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:  # unseeded: one random stream per request
            return self._generators[request.request_id]
        return position_generator(seed, request.num_tokens)

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Convenience for one request alone: yields its tokens as they are sampled; raises
        SamplingError if the request ends with a sampling failure."""
        request = self.add_request(prompt_token_ids, params)
        while True:
            for out in self.step():
                if out.request_id == request.request_id:
                    if out.error:
                        raise SamplingError(out.error)
                    yield from out.new_token_ids
                    if out.finished:
                        return
            if not self.has_unfinished():
                return
