"""Structured output in the engine (engine/grammar.py): the masked sampler against a plain
reference, a random tiny model whose output under a JSON schema always validates, the lazy
vocabulary, the matcher following tokens that arrive from elsewhere, a request's own stop
tokens, and the coordinator's torch-free compile check (common/grammar_compile.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jsonschema
import pytest
import torch

from engine.grammar import GrammarBackend, GrammarError, apply_bitmask
from common.grammar_compile import compile_error
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, probabilities
from common.sampling_params import GrammarSpec, SamplingParams
from common.tokenizer import Tokenizer
from reliability.model_factory import make_tiny_hf_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "color", "tags"],
}


def reference_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Bit t % 32 of word t // 32 of bitmask[j] says whether row rows[j] keeps token t."""
    out = logits.clone()
    for j, i in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[j, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[i, t] = -math.inf
    return out


def test_apply_bitmask_matches_the_reference_and_leaves_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    vocab = 75  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab, generator=gen)
    before = logits.clone()
    rows = [0, 2]
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32,
                            generator=gen)
    masked = apply_bitmask(logits, rows, bitmask)
    torch.testing.assert_close(masked, reference_mask(logits, rows, bitmask))
    assert torch.equal(logits, before)  # the caller's logits are never written
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])


def test_masked_sampler_draws_only_allowed_tokens_with_the_reference_distribution():
    gen = torch.Generator().manual_seed(1)
    vocab = 40
    logits = torch.randn(2, vocab, generator=gen) * 3
    allowed = [{3, 17, 31}, {0, 39}]
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for j, ids in enumerate(allowed):
        for t in ids:
            word = int(bitmask[j, t // 32]) | (1 << (t % 32))
            bitmask[j, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    masked = apply_bitmask(logits, [0, 1], bitmask)
    sampled = SamplingParams(temperature=0.7, top_k=0, top_p=1.0)
    # The distribution: softmax over the allowed tokens only, as a plain reference computes it.
    probs = probabilities(masked, [sampled, sampled])
    for j, ids in enumerate(allowed):
        keep = torch.tensor(sorted(ids))
        ref = torch.zeros(vocab)
        ref[keep] = torch.softmax(logits[j, keep] / 0.7, dim=-1)
        torch.testing.assert_close(probs[j], ref)
    # Draws and argmax stay inside the allowed set.
    greedy = SamplingParams(temperature=0)
    sampler = Sampler()
    for seed in range(50):
        g = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1000)]
        tokens = sampler.sample(masked, [sampled, greedy], [[1], [1]], g).tolist()
        assert tokens[0] in allowed[0] and tokens[1] in allowed[1]
    best = max(allowed[1], key=lambda t: logits[1, t])
    assert sampler.sample(masked, [greedy, greedy], [[1], [1]], [None, None]).tolist()[1] == best


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("grammar") / "model", "qwen2")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return Tokenizer.from_path(tiny_dir)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams,
            stops: frozenset[int]) -> tuple[list[int], RequestStatus]:
    request = engine.add_request(prompt, params, stop_token_ids=stops)
    tokens, status = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request.request_id and not out.error, out.error
            tokens += out.new_token_ids
            status = out.status
    return tokens, status


def test_a_random_model_writes_schema_valid_json_and_stops(tiny_dir, tokenizer):
    # A worker's engine: no tokenizer until a grammar needs the vocabulary.
    engine = LLMEngine.from_path(tiny_dir, EngineConfig(
        cache=CacheConfig(num_blocks=64)), load_tokenizer=False)
    prompt = tokenizer.encode("Describe a person.")
    stops = tokenizer.stop_token_ids
    free, _ = run_one(engine, prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                     seed=3, num_predict=40), stops)
    assert not engine.grammars.loaded  # unconstrained traffic never loads it
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free, skip_special_tokens=True))  # noise, as promised

    spec = GrammarSpec("json_schema", PERSON)
    for seed in range(6):
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed, num_predict=400,
                                grammar=spec)
        tokens, status = run_one(engine, prompt, params, stops)
        assert status is RequestStatus.FINISHED_STOPPED  # the grammar completed, then a stop
        assert tokens[-1] in stops
        value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
        jsonschema.validate(value, PERSON)
    assert engine.grammars.compile_count == 1  # once per schema and vocabulary
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    # Ollama's format "json" (any object), greedy, in a batch with a free request. Greedy
    # noise may loop inside a string until the limit: the JSON is then a valid beginning.
    a = engine.add_request(prompt, SamplingParams(temperature=0, num_predict=30,
                                                  grammar=GrammarSpec("json")), stop_token_ids=stops)
    b = engine.add_request(prompt, SamplingParams(temperature=0, num_predict=8), stop_token_ids=stops)
    # A second grammar row in the batch: the rows' masks are filled in parallel (LLExecutor).
    c = engine.add_request(prompt, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=9,
                                                  num_predict=400, grammar=spec),
                           stop_token_ids=stops)
    while engine.has_unfinished():
        engine.step()
    assert c.status is RequestStatus.FINISHED_STOPPED
    jsonschema.validate(json.loads(tokenizer.decode(c.output_token_ids, skip_special_tokens=True)),
                        PERSON)
    assert tokenizer.decode(a.output_token_ids).lstrip().startswith("{")
    assert a.grammar.accepted == a.num_output_tokens - 1  # each draw's mask saw the ones before
    a.grammar.catch_up(a.output_token_ids)  # and the grammar takes the last one too
    assert b.grammar is None and b.num_output_tokens == 8


def test_the_matcher_follows_a_first_token_sampled_elsewhere(tiny_dir, tokenizer):
    """A decode worker's request arrives with its first token (sampled by the prefill worker):
    the matcher accepts it before the first mask, so the mask continues the JSON."""
    backend = GrammarBackend(320, tokenizer_path=tiny_dir)
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"]})

    def request(first: str) -> Request:
        r = Request("r", [5, 6], SamplingParams(temperature=0, grammar=spec), max_tokens=20,
                    stop_token_ids=tokenizer.stop_token_ids)
        for t in tokenizer.encode(first, add_special_tokens=False):
            r.append_token(t)  # as the scheduler does, with no grammar in sight
        return r

    r = request('{"a"')
    masked = backend.mask([r], torch.zeros(1, 320))
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(masked[0] > -math.inf).flatten().tolist()}
    assert r.grammar.accepted == r.num_output_tokens
    assert allowed and all(text.strip() in ("", ":") for text in allowed), allowed
    with pytest.raises(GrammarError, match="does not match"):
        backend.mask([request("[")], torch.zeros(1, 320))
    # An object that lists its properties is closed (common/grammar_compile.py), as Ollama's.
    with pytest.raises(GrammarError, match="does not match"):
        backend.mask([request('{"b"')], torch.zeros(1, 320))


def test_grammar_errors_and_lru(tiny_dir, tokenizer):
    assert compile_error(GrammarSpec("json_schema", '{"type":"foo"}')) == "Invalid type: foo"
    assert compile_error(GrammarSpec("regex", "((")) == 'invalid regex "((": unclosed group'
    assert compile_error(GrammarSpec("lark", 'x: "a"')) == "no start rule found"
    assert compile_error(GrammarSpec("lark", 'start: "yes" | "no"')) is None
    # A keyword llguidance does not enforce is refused, never silently ignored.
    assert "uniqueItems" in compile_error(GrammarSpec("json_schema", {"type": "array",
                                                                      "uniqueItems": True}))
    backend = GrammarBackend(320, tokenizer_path=tiny_dir, cache_size=2)
    specs = [GrammarSpec("regex", f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    for spec in specs + specs[2:]:
        backend.compiled(spec)
    assert backend.compile_count == 3  # the third again is a hit
    backend.compiled(specs[0])  # evicted by the LRU: compiled again
    assert backend.compile_count == 4
    with pytest.raises(GrammarError, match="does not compile"):
        backend.compiled(GrammarSpec("json_schema", {"type": "object", "minProperties": 3,
                                                     "maxProperties": 1}))
    # A request without stop tokens (a prefill worker's) ends on the vocabulary's.
    assert backend.matcher(specs[0], frozenset()).stops == tokenizer.stop_token_ids


def test_a_request_that_names_its_own_stop_token_ends_on_it(tiny_dir, tokenizer):
    """The complete grammar allows the request's stop tokens and no others: not the
    vocabulary's, and not its own before the grammar may end."""
    backend = GrammarBackend(320, tokenizer_path=tiny_dir)
    own = next(t for t in range(100, 320) if t not in tokenizer.stop_token_ids)
    spec = GrammarSpec("lark", 'start: "yes" | "no"')
    r = Request("r", [5, 6], SamplingParams(temperature=0, grammar=spec), max_tokens=20,
                stop_token_ids=frozenset({own}))

    def allowed() -> set[int]:
        return set(torch.nonzero(backend.mask([r], torch.zeros(1, 320))[0] > -math.inf)
                   .flatten().tolist())

    first = allowed()
    assert own not in first and not first & tokenizer.stop_token_ids
    assert {tokenizer.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    for t in tokenizer.encode("yes", add_special_tokens=False):
        r.append_token(t)
    assert allowed() == {own}
    r.append_token(own)
    r.grammar.catch_up(r.output_token_ids)
    assert r.grammar.ended


def test_the_coordinator_checks_grammars_without_importing_torch():
    code = (
        "import sys\n"
        "import coordinator.service\n"
        "from common.grammar_compile import check_grammar\n"
        "from common.errors import InvalidOptionError\n"
        "from common.sampling_params import GrammarSpec\n"
        "check_grammar(GrammarSpec('json_schema', {'type': 'object'}))\n"
        "try:\n"
        "    check_grammar(GrammarSpec('json_schema',\n"
        "                              {'type': 'integer', 'minimum': 5, 'maximum': 1}))\n"
        "except InvalidOptionError as e:\n"
        "    print('refused:', e)\n"
        "print('torch' in sys.modules, 'llguidance' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out == ["refused: the JSON schema does not compile: Unsatisfiable schema: minimum (5) "
                   "is greater than maximum (1)", "False True"]


def test_a_migrated_request_resumes_its_grammar_after_the_tokens_it_generated(tiny_dir, tokenizer):
    """A request that moved after a worker died arrives with its earlier output at the end of
    its prompt (num_prior_output_tokens): its grammar continues from there, not from the start."""
    backend = GrammarBackend(320, tokenizer_path=tiny_dir)
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"]})
    earlier = tokenizer.encode('{"a"', add_special_tokens=False)
    moved = Request("r~1", [5, 6, *earlier], SamplingParams(temperature=0, grammar=spec),
                    max_tokens=20, stop_token_ids=tokenizer.stop_token_ids,
                    num_prior_output_tokens=len(earlier))
    masked = backend.mask([moved], torch.zeros(1, 320))
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(masked[0] > -math.inf).flatten().tolist()}
    assert moved.grammar.accepted == len(earlier)
    assert allowed and all(text.strip() in ("", ":") for text in allowed), allowed
    fresh = Request("r", [5, 6, *earlier], SamplingParams(temperature=0, grammar=spec),
                    max_tokens=20, stop_token_ids=tokenizer.stop_token_ids)
    masked = backend.mask([fresh], torch.zeros(1, 320))  # without it: the JSON starts over
    assert "{" in {tokenizer.decode([t]).strip()
                   for t in torch.nonzero(masked[0] > -math.inf).flatten().tolist()}
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        Request("x", [1, 2], SamplingParams(), 4, num_prior_output_tokens=2)
