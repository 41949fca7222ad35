"""The response cache (coordinator/response_cache.py) in-process: keys, eligibility, LRU bounds
and the semantic index, with a scripted request flow and embedder in place of the workers.
The cluster test (test_response_cache_cluster.py) drives it through the client APIs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coordinator.generation import Generation
from coordinator.metrics import Metrics, RequestTimings
from coordinator.request_flow import FlowOutcome, FlowRequest, TokenIds, WorkerError
from coordinator.response_cache import (
    EMBED_TEMPLATE,
    ResponseCache, ResponseCacheCollector, eligible, header_value, last_user_text, without_turn,
)
from coordinator.response_store import AnswerStore, CachedAnswer, entry_bytes
from coordinator.response_cache_config import DEFAULT_THRESHOLD, ResponseCacheConfig
from common.logprobs import TokenLogprob
from common.pooling import Pooling
from common.sampling_params import GrammarSpec, SamplingParams
from tests.helpers.coordinator_fakes import load_model, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0, num_predict=8)
CHUNKS = ([40], [41, 42], [43], [44, 45, 46])  # as a speculative decode worker sends them


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("rc") / "m"))


class Workers:
    """Stands in for Coordinator.begin and .embed: counts what reached the workers."""

    def __init__(self, model, fail: bool = False, vectors: dict[str, list[float]] | None = None):
        self.model, self.fail, self.vectors = model, fail, vectors or {}
        self.begun: list[FlowRequest] = []
        self.embedded: list[list[int]] = []
        self.metrics = Metrics(["tiny"]).of("tiny")

    async def begin(self, request, timings, keep_alive_s, model) -> Generation:
        self.begun.append(request)
        return Generation(request, timings, _Flow(self.fail), model.tokenizer, self.metrics,
                          release=lambda: None)

    async def embed(self, inputs, normalize, timings, model, pooling):
        assert pooling is Pooling.LAST  # the turn in its template, its last position's state
        self.embedded.append(inputs[0])
        text = model.tokenizer.decode(inputs[0], skip_special_tokens=True)
        head, tail = EMBED_TEMPLATE.split("{}")
        assert text.startswith(head) and text.endswith(tail), text
        vector = np.asarray(self.vectors[text[len(head):-len(tail)]], dtype=np.float64)
        return [list(vector / np.linalg.norm(vector))]


class _Flow:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def stream(self, req, out: FlowOutcome):
        for i, ids in enumerate(CHUNKS):
            if self.fail and i == 2:
                raise WorkerError("decode worker died")
            logprobs = ([TokenLogprob(t, -0.5, ((t, -0.5), (t + 1, -1.0))) for t in ids]
                        if req.params.logprobs is not None else None)
            yield TokenIds(ids, logprobs)
        out.finish_reason = "length"


def request(model, params=GREEDY, prompt="[sys] be brief [user] What is 2 + 2? [end]",
            salt=b"", max_tokens=8) -> FlowRequest:
    return FlowRequest(request_id="r", prompt_ids=model.tokenizer.encode(prompt), params=params,
                       max_tokens=max_tokens, stop_token_ids=frozenset({2}), cache_salt=salt)


async def ask(cache: ResponseCache, workers: Workers, req: FlowRequest,
              turn: str | None = None) -> tuple[Generation, str]:
    g = await cache.submit(req, RequestTimings(), None, workers.model, workers.metrics,
                           workers.begin, workers.embed, turn)
    try:
        text = "".join([piece async for piece in g.pieces()])
    finally:
        await g.close()
    return g, text


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# ---- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("spec, expected", [
    ("exact", ResponseCacheConfig("exact")),
    ("semantic", ResponseCacheConfig("semantic", DEFAULT_THRESHOLD)),
    ("semantic:threshold=0.9", ResponseCacheConfig("semantic", 0.9)),
    ("exact:entries=3,bytes=5000", ResponseCacheConfig("exact", max_entries=3, max_bytes=5000)),
    ("semantic:model=qwen3-embedding,threshold=0.8",
     ResponseCacheConfig("semantic", 0.8, embed_model="qwen3-embedding")),
    ("semantic:threshold=0.8,model=e,match=literals",
     ResponseCacheConfig("semantic", 0.8, embed_model="e", match="literals")),
    ("semantic:match=words", ResponseCacheConfig("semantic")),
])
def test_config_parses_the_flag(spec, expected):
    assert ResponseCacheConfig.parse(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("fuzzy", "mode must be one of exact, semantic"),
    ("exact:threshold=0.9", "semantic mode only"),
    ("semantic:threshold=1.5", "cosine similarity in -1..1"),
    ("semantic:threshold=high", "threshold must be a number"),
    ("exact:entries=0", "max_entries must be an integer >= 1"),
    ("exact:size=3", "expected key=value with keys threshold, model, match, entries, bytes"),
    ("semantic:model=e", "give a threshold with model=, measured for that model"),
    ("exact:model=e", "model applies to the semantic mode only"),
    ("exact:match=literals", "match applies to the semantic mode only"),
    ("semantic:match=any", "match must be one of words, literals"),
    ("semantic:match=literals", "match=literals needs an embedding model"),
    ("semantic:model=,threshold=0.8", "model must be a model name"),
])
def test_config_refuses_bad_flags_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        ResponseCacheConfig.parse(spec)


# ---- exact mode -------------------------------------------------------------------------------

def test_identical_deterministic_request_is_replayed_without_a_worker(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)

    async def scenario():
        first, text = await ask(cache, workers, request(model))
        again, replayed = await ask(cache, workers, request(model))
        return first, text, again, replayed

    first, text, again, replayed = run(scenario())
    assert (first.cache, again.cache) == ("miss", "hit")
    assert len(workers.begun) == 1
    assert replayed == text and again.output_ids == first.output_ids
    assert again.chunk_sizes == [len(c) for c in CHUNKS]  # streamed as it was computed
    assert again.done_reason == first.done_reason == "length"
    assert again.timings.output_tokens == first.timings.output_tokens
    assert again.outcome.cached_tokens == len(again.request.prompt_ids)  # none computed again
    assert (cache.stats.hits_exact, cache.stats.misses, len(cache.store)) == (1, 1, 1)


ANSWER_CHANGING = {
    "temperature": dict(temperature=0.5, seed=1),
    "seed": dict(seed=7),
    "top_k": dict(top_k=1),
    "top_p": dict(top_p=0.5),
    "min_p": dict(min_p=0.1),
    "typical_p": dict(typical_p=0.5),
    "repeat_penalty": dict(repeat_penalty=1.3),
    "repeat_last_n": dict(repeat_last_n=8),
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "num_predict": dict(num_predict=9),
    "stop": dict(stop=("\n",)),
    "num_ctx": dict(num_ctx=64),
    "grammar": dict(grammar=GrammarSpec("json")),
    "grammar schema": dict(grammar=GrammarSpec("json_schema", {"type": "object"})),
    "logprobs": dict(logprobs=0),
    "top logprobs": dict(logprobs=3),
    "prompt_logprobs": dict(prompt_logprobs=0),
    "min_tokens": dict(min_tokens=2),
    "logit_bias": dict(logit_bias={5: 3.0}),
    "stop_token_ids": dict(stop_token_ids=(9,)),
    "ignore_eos": dict(ignore_eos=True),
    "speculative": dict(speculative=False),
}


@pytest.mark.parametrize("change", list(ANSWER_CHANGING))
def test_any_option_that_changes_the_answer_is_a_miss(model, change):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)
    changed = replace(GREEDY, **ANSWER_CHANGING[change])
    assert changed != GREEDY

    async def scenario():
        await ask(cache, workers, request(model))
        g, _ = await ask(cache, workers, request(model, changed))
        return g

    assert run(scenario()).cache == "miss"
    assert len(workers.begun) == 2


@pytest.mark.parametrize("other", [
    dict(prompt="[sys] be brief [user] What is 2 + 3? [end]"),  # the rendered prompt
    dict(salt=b"tenant-b"),  # another API key's tenant
    dict(max_tokens=7),  # the same num_predict in a smaller context room
])
def test_prompt_tenant_and_limits_are_part_of_the_key(model, other):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)

    async def scenario():
        await ask(cache, workers, request(model))
        g, _ = await ask(cache, workers, request(model, **other))
        return g

    assert run(scenario()).cache == "miss"


def test_another_model_fingerprint_misses(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)
    changed = replace(model, fingerprint=model.fingerprint + "-new-weights")

    async def scenario():
        await ask(cache, workers, request(model))
        workers.model = changed
        g, _ = await ask(cache, workers, request(changed))
        return g

    assert run(scenario()).cache == "miss"


@pytest.mark.parametrize("params, served", [
    (SamplingParams(temperature=0.8), False),  # sampled, random seed
    (SamplingParams(temperature=0.8, cache=True), True),  # ... the client opted in
    (SamplingParams(temperature=0.8, seed=3), True),  # seeded: deterministic
    (SamplingParams(temperature=0, top_k=40), True),
    (SamplingParams(temperature=0.8, top_k=1), True),  # argmax in all but name
    (SamplingParams(temperature=0, cache=False), False),  # the client opted out
])
def test_only_deterministic_or_opted_in_requests_are_served(model, params, served):
    assert eligible(params) is served
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)

    async def scenario():
        a, _ = await ask(cache, workers, request(model, params))
        b, _ = await ask(cache, workers, request(model, params))
        return a, b

    a, b = run(scenario())
    assert (a.cache, b.cache) == (("miss", "hit") if served else ("bypass", "bypass"))
    assert len(workers.begun) == (1 if served else 2)
    assert len(cache.store) == (1 if served else 0)


def test_logprobs_are_replayed_with_their_tokens(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)
    params = replace(GREEDY, logprobs=2)

    async def scenario():
        a, _ = await ask(cache, workers, request(model, params))
        b, _ = await ask(cache, workers, request(model, params))
        return a, b

    a, b = run(scenario())
    assert b.cache == "hit" and b.logprobs == a.logprobs and len(b.logprobs) == 7


def test_a_failed_answer_is_not_stored(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model, fail=True)
    with pytest.raises(WorkerError):
        run(ask(cache, workers, request(model)))
    assert len(cache.store) == 0 and cache.stats.stored == 0


def test_an_abandoned_answer_is_not_stored(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)

    async def scenario():
        g = await cache.submit(request(model), RequestTimings(), None, model, workers.metrics,
                               workers.begin, workers.embed)
        pieces = g.pieces()
        await anext(pieces)  # the client left after its first piece
        await g.close()

    run(scenario())
    assert len(cache.store) == 0


# ---- bounds -----------------------------------------------------------------------------------

def _answer(n: int, vector=None, partition=None) -> CachedAnswer:
    return CachedAnswer(tuple(range(n)), (n,), (), (), "stop", 64, partition, vector)


def test_the_lru_keeps_at_most_its_entries(model):
    store = AnswerStore(max_entries=2, max_bytes=1 << 20)
    for key in (b"a", b"b", b"c"):
        store.put(key, _answer(4))
    assert store.get(b"a") is None and store.get(b"b") and store.get(b"c")
    store.get(b"b")  # now the most recent: c goes next
    store.put(b"d", _answer(4))
    assert store.get(b"c") is None and store.get(b"b") and store.get(b"d")
    assert (len(store), store.evicted) == (2, 2)
    assert store.bytes == 2 * entry_bytes(_answer(4))


def test_the_lru_keeps_at_most_its_bytes_and_refuses_what_cannot_fit():
    one = entry_bytes(_answer(100))
    store = AnswerStore(max_entries=100, max_bytes=int(2.5 * one))
    for key in (b"a", b"b", b"c"):
        store.put(key, _answer(100))
    assert len(store) == 2 and store.bytes <= store.max_bytes and store.get(b"a") is None
    assert not store.put(b"huge", _answer(10_000)) and store.get(b"huge") is None
    assert len(store) == 2


def test_eviction_through_the_cache_serves_the_survivors(model):
    cache = ResponseCache(ResponseCacheConfig(max_entries=2))
    workers = Workers(model)
    prompts = [f"[user] question {i} [end]" for i in range(3)]

    async def scenario():
        for p in prompts:
            await ask(cache, workers, request(model, prompt=p))
        return [(await ask(cache, workers, request(model, prompt=p)))[0].cache
                for p in reversed(prompts)]

    # 2 and 1 are kept; 0 was evicted, computed again (evicting the least recent, 2)
    assert run(scenario()) == ["hit", "hit", "miss"]
    assert cache.store.evicted == 2 and len(cache.store) == 2


def test_an_evicted_answer_leaves_the_semantic_index():
    store = AnswerStore(max_entries=1, max_bytes=1 << 20)
    v = np.ones(4, dtype=np.float32) / 2
    store.put(b"a", _answer(3, v, b"p"))
    store.put(b"b", _answer(3, v, b"q"))
    assert store.nearest(b"p", v, 0.0, lambda a: True) is None
    assert store.nearest(b"q", v, 0.0, lambda a: True) is not None


# ---- semantic mode ----------------------------------------------------------------------------

TURNS = {  # the fake embedder's vectors, by the turn's text
    "What is 2 + 2?": [1.0, 0.0, 0.0],
    "What's 2 + 2?": [0.99, 0.1, 0.0],  # cosine 0.995
    "What is 2 + 9?": [0.6, 0.8, 0.0],  # cosine 0.6
    "What is 3 + 2?": [0.9999, 0.01, 0.0],  # cosine 0.99995, another number
    "What is 2 + 2, Bob?": [0.9999, 0.01, 0.0],  # ... another name
    "Tell me what 2 + 2 is?": [0.999, 0.04, 0.0],  # ... words added (a paraphrase)
    "What is not 2 + 2?": [0.9999, 0.01, 0.0],  # ... a negation added
}


def _chat(turn: str, system: str = "be brief") -> str:
    return f"[sys] {system} [user] {turn} [end]"


@pytest.mark.parametrize("turn, system, hit", [
    ("What's 2 + 2?", "be brief", True),  # a paraphrase, above the threshold
    ("What is 2 + 9?", "be brief", False),  # a near miss, below it
    ("What is 3 + 2?", "be brief", False),  # above it, but another number
    ("What is 2 + 2, Bob?", "be brief", False),  # above it, but a name more
    ("Tell me what 2 + 2 is?", "be brief", False),  # above it, but words added
    ("What is not 2 + 2?", "be brief", False),  # above it, but a negation added
    ("What's 2 + 2?", "be verbose", False),  # the rest of the prompt differs
])
def test_semantic_hit_needs_the_threshold_and_everything_else_equal(model, turn, system, hit):
    cache = ResponseCache(ResponseCacheConfig("semantic", threshold=0.95))
    workers = Workers(model, vectors=TURNS)

    async def scenario():
        base = "What is 2 + 2?"
        await ask(cache, workers, request(model, prompt=_chat(base)), base)
        g, _ = await ask(cache, workers, request(model, prompt=_chat(turn, system)), turn)
        return g

    assert run(scenario()).cache == ("hit" if hit else "miss")
    assert cache.stats.hits_semantic == int(hit)
    assert len(workers.embedded) == 2


def test_prompt_logprobs_are_never_served_from_another_prompt(model):
    cache = ResponseCache(ResponseCacheConfig("semantic", threshold=0.95))
    workers = Workers(model, vectors=TURNS)
    params = replace(GREEDY, prompt_logprobs=0)

    async def scenario():
        await ask(cache, workers, request(model, params, _chat("What is 2 + 2?")), "What is 2 + 2?")
        g, _ = await ask(cache, workers, request(model, params, _chat("What's 2 + 2?")),
                         "What's 2 + 2?")
        again, _ = await ask(cache, workers, request(model, params, _chat("What's 2 + 2?")),
                             "What's 2 + 2?")
        return g, again

    g, again = run(scenario())
    assert (g.cache, again.cache) == ("miss", "hit")  # the exact repeat still hits
    assert workers.embedded == []


def test_semantic_hit_must_fit_the_new_requests_limit(model):
    cache = ResponseCache(ResponseCacheConfig("semantic", threshold=0.95))
    workers = Workers(model, vectors=TURNS)

    async def scenario():
        await ask(cache, workers, request(model, prompt=_chat("What is 2 + 2?")),
                  "What is 2 + 2?")
        # the cached answer was cut at 8 tokens ("length"): a room of 7 is another limit
        g, _ = await ask(cache, workers, request(model, prompt=_chat("What's 2 + 2?"),
                                                 max_tokens=7), "What's 2 + 2?")
        return g

    assert run(scenario()).cache == "miss"


def test_semantic_mode_without_a_turn_is_exact_only(model):
    cache = ResponseCache(ResponseCacheConfig("semantic", threshold=-1.0))
    workers = Workers(model, vectors=TURNS)

    async def scenario():
        await ask(cache, workers, request(model, prompt=_chat("What is 2 + 2?")), None)
        g, _ = await ask(cache, workers, request(model, prompt=_chat("What's 2 + 2?")), None)
        # a turn not in the prompt as written: no index either
        h, _ = await ask(cache, workers, request(model, prompt=_chat("What is 2 + 9?")), "absent")
        return g, h

    g, h = run(scenario())
    assert (g.cache, h.cache) == ("miss", "miss") and workers.embedded == []


def test_an_embedding_failure_leaves_the_request_to_the_workers(model):
    cache = ResponseCache(ResponseCacheConfig("semantic"))
    workers = Workers(model, vectors={})  # every embedding raises KeyError

    g, _ = run(ask(cache, workers, request(model, prompt=_chat("What is 2 + 2?")),
                   "What is 2 + 2?"))
    assert g.cache == "miss" and cache.stats.embed_failures == 1 and len(workers.begun) == 1


def test_helpers():
    assert without_turn("a Q b Q c", "Q") == "a Q b \x00turn\x00 c"
    assert without_turn("abc", "Q") is None
    assert last_user_text([{"role": "user", "content": "one"}, {"role": "assistant",
                                                               "content": "x"},
                           {"role": "user", "content": "two"}, {"role": "assistant",
                                                               "content": ""}]) == "two"
    assert last_user_text([{"role": "system", "content": "s"}]) is None
    assert header_value([]) is None
    assert header_value(["hit", "hit"]) == "hit"
    assert header_value(["hit", "miss"]) == "miss"
    assert header_value(["bypass"]) == "bypass"


def test_metrics_series_move(model):
    cache, workers = ResponseCache(ResponseCacheConfig()), Workers(model)
    registry = CollectorRegistry()
    registry.register(ResponseCacheCollector(cache))

    async def scenario():
        await ask(cache, workers, request(model))
        await ask(cache, workers, request(model))
        await ask(cache, workers, request(model, SamplingParams(temperature=0.7)))

    run(scenario())
    text = generate_latest(registry).decode()
    assert 'tandem_response_cache_hits_total{kind="exact"} 1.0' in text
    assert 'tandem_response_cache_hits_total{kind="semantic"} 0.0' in text
    assert "tandem_response_cache_misses_total 1.0" in text
    assert "tandem_response_cache_bypassed_total 1.0" in text
    assert "tandem_response_cache_entries 1.0" in text
    assert f"tandem_response_cache_bytes {float(cache.store.bytes)}" in text
    assert cache.store.bytes > 0


# ---- semantic mode with an embedding model of its own (model=NAME) ------------------------------

class EmbedderWorkers(Workers):
    """The embedding model's vectors: the turn as written, in the embedder's tokens and its
    own pooling (as /api/embed of that model), by the turn's text."""

    def __init__(self, model, embedder, vectors):
        super().__init__(model, vectors=vectors)
        self.embedder = embedder
        self.calls: list[tuple[str, Pooling]] = []

    async def embed(self, inputs, normalize, timings, model, pooling):
        assert model is self.embedder and normalize
        self.embedded.append(inputs[0])
        assert inputs[0] == model.tokenizer.encode(model.tokenizer.decode(
            inputs[0], skip_special_tokens=True))  # the turn alone, special tokens as /api/embed
        text = model.tokenizer.decode(inputs[0], skip_special_tokens=True)
        self.calls.append((text, pooling))
        vector = np.asarray(self.vectors[text], dtype=np.float64)
        return [list(vector / np.linalg.norm(vector))]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("rc") / "e"))


def _finder(models: dict):
    async def find_model(name):
        return models[name]  # KeyError: not served (an embedding failure)
    return find_model


@pytest.mark.parametrize("match, turn, hit", [
    ("words", "What's 2 + 2?", True),  # the same words
    ("words", "Tell me what 2 + 2 is?", False),  # other words: the words rule
    ("literals", "Tell me what 2 + 2 is?", True),  # ... left to the embedding model
    ("literals", "What is 3 + 2?", False),  # another number: never
    ("literals", "What is 2 + 2, Bob?", False),  # another name: never
])
def test_an_embedding_model_embeds_the_turns(model, embedder, match, turn, hit):
    assert embedder.fingerprint != model.fingerprint
    cache = ResponseCache(ResponseCacheConfig("semantic", 0.95, embed_model="e", match=match),
                          _finder({"e": embedder}))
    workers = EmbedderWorkers(model, embedder, TURNS)

    async def scenario():
        base = "What is 2 + 2?"
        await ask(cache, workers, request(model, prompt=_chat(base)), base)
        g, _ = await ask(cache, workers, request(model, prompt=_chat(turn)), turn)
        return g

    assert run(scenario()).cache == ("hit" if hit else "miss")
    assert workers.calls == [("What is 2 + 2?", embedder.config.pooling), (turn, embedder.config.pooling)]


def test_another_embedding_model_starts_an_empty_index(model, embedder):
    """Vectors of two models are not comparable: a changed embedder (the same name pulled
    again) matches nothing stored before it."""
    models = {"e": embedder}
    cache = ResponseCache(ResponseCacheConfig("semantic", 0.95, embed_model="e"), _finder(models))
    workers = EmbedderWorkers(model, embedder, TURNS)

    async def scenario():
        await ask(cache, workers, request(model, prompt=_chat("What is 2 + 2?")), "What is 2 + 2?")
        first, _ = await ask(cache, workers, request(model, prompt=_chat("What's 2 + 2?")),
                             "What's 2 + 2?")
        models["e"] = workers.embedder = replace(embedder, fingerprint="another")
        second, _ = await ask(cache, workers, request(model, prompt=_chat("what's 2 + 2")),
                              "what's 2 + 2")
        return first, second

    first, second = run(scenario())
    assert (first.cache, second.cache) == ("hit", "miss")


def test_an_embedding_model_that_is_not_served_leaves_the_request_to_the_workers(model):
    cache = ResponseCache(ResponseCacheConfig("semantic", 0.95, embed_model="gone"), _finder({}))
    workers = Workers(model, vectors=TURNS)
    g, _ = run(ask(cache, workers, request(model, prompt=_chat("What is 2 + 2?")),
                   "What is 2 + 2?"))
    assert g.cache == "miss" and cache.stats.embed_failures == 1 and len(workers.begun) == 1
    assert workers.embedded == []


def test_a_cache_with_an_embedding_model_needs_a_way_to_find_it():
    with pytest.raises(ValueError, match="needs find_model"):
        ResponseCache(ResponseCacheConfig("semantic", 0.9, embed_model="e"))


@pytest.mark.parametrize("match", ["words", "literals"])
def test_a_turn_longer_than_the_embedders_context_gets_no_semantic_lookup(model, tmp_path, match):
    """Cut to the embedder's context, two turns that share their opening would share a vector
    (cosine 1): one that does not fit is matched exactly only."""
    short = load_model(make_tiny_model_dir(tmp_path / "short", max_position=12))
    opening = "Here is a long shared opening of many words that fills the context, "
    turns = {opening + "summarize it.": [1.0, 0.0, 0.0], opening + "translate it.": [1.0, 0.0, 0.0]}
    cache = ResponseCache(ResponseCacheConfig("semantic", -1.0, embed_model="e", match=match),
                          _finder({"e": short}))
    workers = EmbedderWorkers(model, short, turns)

    async def scenario():
        a, b = turns
        await ask(cache, workers, request(model, prompt=_chat(a)), a)
        g, _ = await ask(cache, workers, request(model, prompt=_chat(b)), b)
        return g

    assert len(short.tokenizer.encode(opening)) > short.context_len
    assert run(scenario()).cache == "miss" and workers.embedded == []
    assert cache.stats.embed_failures == 0  # not a failure: the turn is matched exactly only


def test_a_turn_longer_than_the_chat_models_context_gets_no_semantic_lookup(tmp_path):
    small = load_model(make_tiny_model_dir(tmp_path / "small", max_position=16))
    cache = ResponseCache(ResponseCacheConfig("semantic", threshold=-1.0))
    turn = "What is 2 + 2? " * 20
    workers = Workers(small, vectors={turn: [1.0, 0.0, 0.0]})
    g, _ = run(ask(cache, workers, request(small, prompt=_chat(turn), max_tokens=4), turn))
    assert g.cache == "miss" and workers.embedded == []
