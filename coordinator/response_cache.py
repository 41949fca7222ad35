"""The response cache: a repeated question answered from memory, without a worker.

Opt-in (`--response-cache exact|semantic[:threshold=T,model=NAME,match=literals]`,
coordinator/response_cache_config.py).
Coordinator.submit hands every prepared request to `ResponseCache.submit`, the one place where
requests of every client API (Ollama, OpenAI, the Responses API, gRPC) are admitted:

    request ── eligible? ──no──> workers (cache "bypass")
                  │yes
           exact key found? ──yes──> replay (cache "hit")
                  │no
      semantic: the last user turn's embedding (an Embed RPC: EMBED_TEMPLATE's last position,
      as /api/embed computes it with "pooling": "last"; with model=NAME, that model's vector
      of the turn as written, as /api/embed of NAME computes it) is compared with those of
      past answers whose request matched in everything else;
      best cosine >= threshold? ──yes──> replay (cache "hit")
                  │no
           workers (cache "miss"); a normal finish stores the answer

Eligible: deterministic requests (temperature 0 or top_k 1, or a fixed seed), unless the
request says `cache: true` (then also a sampled one: the client accepts a repeat of an earlier
sample) or `cache: false` (never). Errors, cancellations and client disconnects store nothing.

The exact key is a digest of everything that decides the answer: the model's fingerprint (a
changed model is another key, so nothing of the old one is served), the tenant's salt (the
prefix cache's, coordinator/tenants.py: an API key never sees another's answers), the rendered
prompt's token ids (template, system prompt, history, tools, `think`), every sampling parameter
(SamplingParams: temperature, seed, stop, grammar/format, logprobs, penalties, num_predict,
logit_bias, ...; all but `cache` itself), the stop token set and max_tokens. What the APIs make
of the tokens afterwards (tool-call parsing, thinking, echo, shapes) runs again on a hit, from
the request in hand, so a hit streams exactly like a computed answer.

The semantic key is the same digest with the last user turn cut out of the prompt (its text
replaced by a marker in the decoded prompt), without max_tokens and with the embedding model's
fingerprint (vectors of two models are not comparable: a changed embedder starts an empty
index); within one such partition the turn's vector is compared. A hit must also pass the rules on the turns' words
(coordinator/turn_terms.py: the same numbers, names and symbols, and the same words, each in
the same order once case, punctuation and contractions are set aside: an embedding of a chat
model's hidden states separates neither "12 times 7" from "12 times 8" nor "an egg" from "an
egg white"; with match=literals the first rule only, for an embedding model trusted with
the words) and fit the new request's max_tokens; a request for prompt logprobs is matched
exactly only.

Memory (coordinator/response_store.py): an LRU bounded by entries and by estimated bytes (token
ids, logprobs, vector, keys); an evicted answer leaves the semantic index with it. A replayed
answer's timings are its own (arrival to each replayed token: honest, and tiny), its whole
prompt counts as cached tokens (usage, `tandem.cached_tokens`: none was computed again), it is
marked `"cache": "hit"`, and it is counted by the tandem_response_cache_* series, not by vLLM's
latency series (they describe the workers).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from coordinator.generation import Generation
from coordinator.metrics import ModelMetrics, RequestTimings
from coordinator.prompts import encode, off_loop
from coordinator.request_flow import FlowOutcome, FlowRequest, TokenIds
from coordinator.response_cache_config import ResponseCacheConfig
from coordinator.response_store import AnswerStore, CachedAnswer
from coordinator.turn_terms import TurnTerms
from common.pooling import Pooling
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from coordinator.model import ServedModel

log = logging.getLogger(__name__)

HIT, MISS, BYPASS = "hit", "miss", "bypass"
# The HTTP answer's header (coordinator/response_cache_header.py): hit | miss | bypass.
HEADER = "X-Tandem-Cache"
# Each HTTP request's cache outcomes (one per Generation: n choices give n), for its header.
# The middleware sets a list; Generations append to it (a list: visible across context copies).
marks: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "tandem_response_cache_marks", default=None)
_TURN = "\x00turn\x00"  # stands for the last user turn in a semantic partition's prompt text
# The turn as the semantic mode embeds it, with the last position's state (PromptEOL,
# engine/embedding.py): the model's next token would be the turn's meaning in one word, so that
# state separates questions that differ in one common word which the mean of every position's
# does not ("ocean" / "desert"; README, Response cache).
EMBED_TEMPLATE = 'This sentence : "{}" means in one word:"'


def eligible(params: SamplingParams) -> bool:
    """Whether the cache may answer (and store) a request with these parameters."""
    if params.cache is not None:
        return params.cache
    return params.greedy or params.seed is not None


def _digest(*parts: object) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _answer_params(params: SamplingParams) -> SamplingParams:
    return replace(params, cache=None)  # whether to use the cache changes no answer


def exact_key(fingerprint: str, request: FlowRequest) -> bytes:
    return _digest("exact", fingerprint, request.cache_salt, request.prompt_ids,
                   _answer_params(request.params), sorted(request.stop_token_ids),
                   request.max_tokens)


def partition_key(fingerprint: str, request: FlowRequest, prompt_without_turn: str,
                  embedder_fingerprint: str) -> bytes:
    """embedder_fingerprint: the model whose vectors the partition holds (the chat model's own
    where it embeds its turns), so a changed embedder starts an empty index."""
    return _digest("semantic", fingerprint, request.cache_salt, prompt_without_turn,
                   _answer_params(request.params), sorted(request.stop_token_ids),
                   embedder_fingerprint)


def without_turn(prompt_text: str, turn: str) -> str | None:
    """The prompt's text with its last occurrence of `turn` (the last user turn, which the
    template wrote after everything but the generation prompt) replaced by a marker; None when
    the turn is not found as written (then only the exact key applies)."""
    at = prompt_text.rfind(turn) if turn else -1
    if at < 0:
        return None
    return prompt_text[:at] + _TURN + prompt_text[at + len(turn):]


def last_user_text(messages: Sequence[dict]) -> str | None:
    """The text of the last user message of a chat, when it is plain text."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) and content else None
    return None


@dataclass
class CacheStats:
    hits_exact: int = 0
    hits_semantic: int = 0
    misses: int = 0
    bypassed: int = 0  # requests not eligible (sampled without `cache: true`, or cache false)
    stored: int = 0
    evicted: int = 0
    embed_failures: int = 0  # semantic lookups skipped because the embedding failed


class ReplayFlow:
    """A cached answer as a request flow (request_flow.RequestFlow.stream's contract), so the
    Generation around it detokenizes, applies stop strings and times it as it does a computed
    one: the same pieces, chunk by chunk."""

    def __init__(self, answer: CachedAnswer) -> None:
        self.answer = answer

    async def stream(self, req: FlowRequest, out: FlowOutcome) -> AsyncIterator[TokenIds]:
        a = self.answer
        out.cached_tokens = len(req.prompt_ids)  # nothing of the prompt was computed again
        out.placement_reason = "response cache"
        start = 0
        for i, size in enumerate(a.chunk_sizes):
            ids = a.output_ids[start:start + size]
            logprobs = a.logprobs[start:start + size] if a.logprobs else ()
            yield TokenIds(ids, list(logprobs), list(a.prompt_logprobs) if i == 0 else None)
            start += size
            await asyncio.sleep(0)  # a long answer does not hold the event loop
        out.finish_reason = a.finish_reason


Begin = Callable[[FlowRequest, RequestTimings, "float | None", "ServedModel | None"],
                 Awaitable[Generation]]
Embed = Callable[[list[list[int]], bool, RequestTimings, "ServedModel | None", Pooling],
                 Awaitable[list[list[float]]]]
FindModel = Callable[[str], Awaitable["ServedModel"]]


class ResponseCache:
    def __init__(self, config: ResponseCacheConfig, find_model: FindModel | None = None) -> None:
        """find_model: the served model of a name (Coordinator.find_model), for
        config.embed_model; required when that is set."""
        if config.embed_model is not None and find_model is None:
            raise ValueError("a response cache with an embedding model needs find_model")
        self.config = config
        self.find_model = find_model
        self.store = AnswerStore(config.max_entries, config.max_bytes)
        self.stats = CacheStats()

    async def submit(self, request: FlowRequest, timings: RequestTimings,
                     keep_alive_s: float | None, model: ServedModel, metrics: ModelMetrics,
                     begin: Begin, embed: Embed, turn: str | None = None) -> Generation:
        """The request answered from the cache, or admitted by `begin` (Coordinator.begin)
        and stored once it finished. turn: the request's last user turn as text (chat: the
        last user message; generate and completions: the prompt), for the semantic mode."""
        if not eligible(request.params):
            self.stats.bypassed += 1
            return self._mark(await begin(request, timings, keep_alive_s, model), BYPASS)
        key = exact_key(model.fingerprint, request)
        answer = self.store.get(key)
        if answer is not None:
            self.stats.hits_exact += 1
            return self._replay(request, timings, model, metrics, answer)
        partition = vector = None
        # Prompt logprobs describe one prompt's tokens: another prompt's are no answer.
        if self.config.semantic and turn and request.params.prompt_logprobs is None:
            partition, vector = await self._turn_vector(request, model, turn, embed)
        terms = None
        if partition is not None and vector is not None and turn:
            terms = await off_loop(TurnTerms.of, turn)  # linear, but a turn may be long
            words = self.config.match == "words"

            def fits(a: CachedAnswer) -> bool:
                if a.terms is None or not terms.same_question(a.terms, words):
                    return False  # another number, name or word: another question
                if a.finish_reason == "length":  # cut by its limit: the same limit only
                    return a.max_tokens == request.max_tokens
                return len(a.output_ids) <= request.max_tokens

            found = self.store.nearest(partition, vector, self.config.threshold, fits)
            if found is not None:
                self.stats.hits_semantic += 1
                log.info("request %s: semantic cache hit at cosine %.4f", request.request_id,
                         found[1])
                return self._replay(request, timings, model, metrics, found[0])
        self.stats.misses += 1
        generation = await begin(request, timings, keep_alive_s, model)
        generation.on_finish = lambda g: self._put(key, g, partition, vector, terms)
        return self._mark(generation, MISS)

    async def _turn_vector(self, request: FlowRequest, model: ServedModel, turn: str,
                           embed: Embed) -> tuple[bytes | None, np.ndarray | None]:
        """The semantic partition of the request and its turn's unit vector (None, None when
        the turn is not in the prompt as written, is longer than the embedding model's
        context, or the embedding failed)."""
        tokenizer = model.tokenizer
        text = await off_loop(tokenizer.decode, request.prompt_ids)
        rest = without_turn(text, turn)
        if rest is None:
            return None, None
        try:
            found = await self._embed_input(model, turn)
            if found is None:
                return None, None
            embedder, ids, pooling = found
            vectors = await embed([ids], True, RequestTimings(), embedder, pooling)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the request goes on without the index)
            self.stats.embed_failures += 1
            log.warning("request %s: no semantic cache lookup, the embedding failed: %s",
                        request.request_id, exc)
            return None, None
        return (partition_key(model.fingerprint, request, rest, embedder.fingerprint),
                np.asarray(vectors[0], dtype=np.float32))

    async def _embed_input(self, model: ServedModel,
                           turn: str) -> tuple[ServedModel, list[int], Pooling] | None:
        """The model that embeds the turn, its token ids and the pooling; None when the turn
        does not fit that model's context (a vector of part of it would stand for every turn
        that shares that part: no semantic lookup then). The chat model itself: the turn in
        EMBED_TEMPLATE, the last position. An embedding model (config.embed_model): the turn
        as written, that model's own pooling, as /api/embed of that model computes it
        (coordinator/embedding_routes.py), so its cosines there are the cache's."""
        if self.config.embed_model is None:
            embedder, text, pooling = model, EMBED_TEMPLATE.format(turn), Pooling.LAST
        else:
            assert self.find_model is not None  # __init__
            embedder = await self.find_model(self.config.embed_model)
            text, pooling = turn, embedder.config.pooling
        ids = await off_loop(encode, embedder.tokenizer, text, embedding=True)
        if len(ids) > embedder.context_len:
            return None
        return embedder, ids, pooling

    def _replay(self, request: FlowRequest, timings: RequestTimings, model: ServedModel,
                metrics: ModelMetrics, answer: CachedAnswer) -> Generation:
        timings.admitted = time.monotonic()  # no queue: nothing runs on a worker
        generation = Generation(request, timings, ReplayFlow(answer), model.tokenizer,
                                metrics, release=lambda: None)
        return self._mark(generation, HIT)

    def _put(self, key: bytes, g: Generation, partition: bytes | None,
             vector: np.ndarray | None, terms: TurnTerms | None = None) -> None:
        answer = CachedAnswer(
            output_ids=tuple(g.output_ids), chunk_sizes=tuple(g.chunk_sizes),
            logprobs=tuple(g.logprobs), prompt_logprobs=tuple(g.prompt_logprobs),
            finish_reason=g.done_reason or "stop", max_tokens=g.request.max_tokens,
            partition=partition, vector=vector, terms=terms)
        if self.store.put(key, answer):
            self.stats.stored += 1

    @staticmethod
    def _mark(generation: Generation, outcome: str) -> Generation:
        generation.cache = outcome
        found = marks.get()
        if found is not None:
            found.append(outcome)
        return generation


def header_value(outcomes: Sequence[str]) -> str | None:
    """One HTTP answer's X-Tandem-Cache from its Generations' outcomes: hit when all were,
    miss when any was computed and eligible, else bypass; None without a Generation."""
    if not outcomes:
        return None
    if all(o == HIT for o in outcomes):
        return HIT
    return MISS if MISS in outcomes else BYPASS


def cache_state(generations: Sequence[Generation]) -> str | None:
    """The `tandem.cache` field of an answer of several choices (as header_value)."""
    return header_value([g.cache for g in generations if g.cache is not None])


class ResponseCacheCollector:
    """The cache's Prometheus series, read at each scrape of /metrics."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s, store = self.cache.stats, self.cache.store
        hits = CounterMetricFamily("tandem_response_cache_hits", "Requests answered from the "
                                   "response cache, by how the answer was found", labels=["kind"])
        hits.add_metric(["exact"], s.hits_exact)
        hits.add_metric(["semantic"], s.hits_semantic)
        yield hits
        for name, doc, value in (
                ("misses", "Eligible requests the response cache could not answer", s.misses),
                ("bypassed", "Requests not eligible for the response cache (sampled without "
                             "cache true, or cache false)", s.bypassed),
                ("stores", "Answers stored in the response cache", s.stored),
                ("evictions", "Answers the response cache dropped for its bounds", store.evicted),
                ("embed_failures", "Semantic lookups skipped because the embedding failed",
                 s.embed_failures)):
            family = CounterMetricFamily(f"tandem_response_cache_{name}", doc)
            family.add_metric([], value)
            yield family
        yield GaugeMetricFamily("tandem_response_cache_entries", "Answers in the response cache",
                                value=len(store))
        yield GaugeMetricFamily("tandem_response_cache_bytes", "Estimated bytes of the response "
                                "cache's answers", value=store.bytes)
