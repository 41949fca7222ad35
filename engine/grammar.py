"""Structured output: a request's GrammarSpec as an llguidance matcher over the model's
vocabulary, and the token mask applied where each token is sampled.

    GrammarSpec --grammar_text (common/grammar_compile.py)--> llguidance grammar text
                --once per (spec, vocabulary), LRU--> a pristine LLMatcher
    Request.grammar: a RequestGrammar (a deep copy of that matcher, ~10 us) made at the
    request's first draw
    each sampling pass, for the rows that have a grammar only (GrammarBackend.mask):
        catch up     the matcher consumes the output tokens it has not seen yet
        fill         the bitmask of tokens the grammar allows next (llguidance, GIL released;
                     rows in parallel on an LLExecutor when there are several)
        mask         their logits stay, every other one becomes -inf; then the usual sampler

Invariant: a request's matcher has consumed exactly `generated_token_ids[:accepted]` (its
output, plus the output of earlier placements that a migrated request carries at the end of its
prompt: Request.num_prior_output_tokens), and consumes the rest before its next mask. So every
token reaches the matcher whoever appended it (this engine's sampler, a prefill worker's first
token arriving with the KV, a recompute after preemption, a worker that died mid-answer): Request.append_token stays the one place tokens are appended, and nothing on that
path has to know about grammars. A token the grammar refuses (only possible for a token this
engine did not mask, e.g. from a peer without the grammar) ends the request with an error.

Termination: llguidance's vocabulary (LLTokenizer) carries the vocabulary's end-of-generation
tokens as its EOS set, and once the grammar is complete its mask allows only those. A request
whose stop tokens differ (it names its own) gets its own set there instead, allowed exactly
when the grammar may end. So the next token is a stop token and the request ends "stop" by the
ordinary stop-token rule.

Cost: a batch without a grammar pays one attribute test per row (LLMEngine._sample_rows).
llguidance (torch-free, ~30 ms to import) and the vocabulary (a tokenizer, which workers do not
otherwise load, and llguidance's token trie over it: ~0.2 s for SmolLM2's 49k tokens) come with
the first grammar request of a process, on the engine thread. A new schema then compiles in
about a millisecond, and the mask costs ~0.3 ms a step at batch 1 (median over JSON answers of
SmolLM2 on a 2-core Xeon: fill ~0.01 ms on a key to ~1 ms inside a free string, apply ~0.05 ms
over 49k tokens), ~1.1 ms at batch 4 on one thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.grammar_compile import clean_error, grammar_text
from common.sampling_params import GrammarSpec
from engine.request_grammar import GrammarError, RequestGrammar

if TYPE_CHECKING:
    from engine.request import Request
    from common.tokenizer import Tokenizer

COMPILED_CACHE_SIZE = 64  # compiled grammars kept per engine (one vocabulary)


def _llguidance() -> Any:
    import llguidance  # noqa: PLC0415 - only once a grammar is used

    return llguidance


class GrammarBackend:
    """Compiles and caches grammars for one vocabulary and masks logits; one per engine. The
    vocabulary is `tokenizer`'s, or else that of the tokenizer at `tokenizer_path` (a GGUF file
    or HF directory), read at the first grammar request.

    Threads: `mask` runs on the engine thread. `matcher` (which may build the vocabulary and
    compile) is thread-safe, so that workers call it on their grammar thread before a request
    reaches the engine (worker/engine_loop.py `grammar_for`) and a large grammar never stalls
    the batch; the lock guards only the vocabulary and the cache, never a compile."""

    def __init__(self, vocab_size: int, tokenizer: Tokenizer | None = None,
                 tokenizer_path: str | Path | None = None,
                 cache_size: int = COMPILED_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's (the logits' width), not the tokenizer's
        self.cache_size = cache_size
        self._vocab: Any = None  # llguidance's LLTokenizer, built at the first grammar
        self._words = 0  # int32 words in one row of the bitmask
        self._executor: Any = None  # an LLExecutor, for batches of several grammar rows
        self._limits: Any = None
        self._stop_ids: frozenset[int] = frozenset()  # the vocabulary's end-of-generation tokens
        self._eos: frozenset[int] = frozenset()  # llguidance's EOS set (the same, if any)
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.compile_count = 0  # grammars compiled so far (cache misses)
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether llguidance's vocabulary has been built (never, without a grammar)."""
        return self._vocab is not None

    def _load(self) -> Any:
        with self._lock:
            return self._load_locked()

    def _load_locked(self) -> Any:
        if self._vocab is None:
            llg = _llguidance()
            tokenizer = self._tokenizer
            if tokenizer is None:
                if self._tokenizer_path is None:
                    raise GrammarError("structured output needs the model's vocabulary, and "
                                       "this engine has no tokenizer")
                from common.tokenizer import Tokenizer  # noqa: PLC0415

                tokenizer = Tokenizer.from_path(Path(self._tokenizer_path))
            self._stop_ids = tokenizer.stop_token_ids
            # llguidance reads the vocabulary and its encoding (byte-level, byte-fallback) from
            # our own tokenizers.Tokenizer's JSON. Its width covers the logits' and the
            # tokenizer's both; ids past the tokenizer's are never allowed.
            vocab = llg.LLTokenizer(tokenizer.backend.to_str(),
                                    n_vocab=max(self.vocab_size, tokenizer.vocab_size),
                                    eos_token=sorted(self._stop_ids) or None)
            self._limits = llg.LLParserLimits(verbose_errors=False)
            self._words = (vocab.vocab_size + 31) // 32
            self._eos = frozenset(vocab.eos_tokens)
            self._vocab = vocab
        return self._vocab

    def compiled(self, spec: GrammarSpec) -> Any:
        """The pristine matcher of `spec` (LRU of cache_size), copied for each request;
        GrammarError if it does not compile."""
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        vocab = self._load()
        llg = _llguidance()
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise GrammarError(f"the {spec.kind} grammar does not compile: "
                               f"{clean_error(spec.kind, str(exc))}") from None
        result = llg.LLMatcher(vocab, text, log_level=0, limits=self._limits)
        if result.is_error():
            raise GrammarError(f"the {spec.kind} grammar does not compile: "
                               f"{clean_error(spec.kind, result.get_error())}")
        with self._lock:
            self.compile_count += 1
            self._compiled[spec] = result
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return result

    def matcher(self, spec: GrammarSpec, stop_token_ids: frozenset[int]) -> RequestGrammar:
        """A fresh matcher whose complete grammar allows only the request's stop tokens (the
        tokens that end it), or the vocabulary's end-of-generation tokens for a request that
        names none: a prefill worker's request carries no stop tokens, and the coordinator
        sends the vocabulary's own set to the decode worker."""
        compiled = self.compiled(spec)
        stops = frozenset(stop_token_ids) or self._stop_ids
        if not stops:
            raise GrammarError("a grammar needs a stop token to end on, and neither the request "
                               "nor the vocabulary has one")
        return RequestGrammar(compiled.deep_copy(), stops, self._eos)

    def mask(self, requests: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with every token that a row's grammar forbids at -inf; rows without
        a grammar unchanged. A new tensor: the caller's logits are never written."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.grammar is not None]
        grammars = []
        for i in rows:
            request = requests[i]
            if request.grammar is None:
                request.grammar = self.matcher(request.sampling_params.grammar,
                                               request.stop_token_ids)
            request.grammar.catch_up(request.generated_token_ids)
            if request.grammar.ended:
                raise GrammarError("the grammar is complete and ended on a token that this "
                                   "request does not stop at")
            grammars.append(request.grammar)
        bitmask = torch.empty(len(rows), self._words, dtype=torch.int32)
        row_bytes = self._words * 4
        if len(grammars) == 1:
            grammars[0].matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        elif grammars:
            if self._executor is None:
                threads = max(1, torch.get_num_threads())
                self._executor = _llguidance().LLExecutor(num_threads=threads)
            self._executor.unsafe_compute_mask_ptr([(g.matcher, j) for j, g in enumerate(grammars)],
                                                   bitmask.data_ptr(), row_bytes, len(grammars))
        for j, grammar in enumerate(grammars):
            if grammar.matcher.is_error():  # e.g. a parser limit reached on this step
                raise GrammarError(clean_error("grammar", grammar.matcher.get_error()))
            if grammar.own_stops:
                self._swap_stops(bitmask[j], grammar.stops)
        return apply_bitmask(logits, rows, bitmask)

    def _swap_stops(self, row: torch.Tensor, stops: frozenset[int]) -> None:
        """In one mask row, llguidance's EOS set (allowed where the grammar may end) becomes
        the request's own stop tokens."""
        words = row.numpy().view(np.uint32)
        limit = words.size * 32

        def bit(t: int) -> bool:
            return t < limit and bool((int(words[t >> 5]) >> (t & 31)) & 1)

        may_end = any(bit(t) for t in self._eos)
        for t in sorted(self._eos | stops):
            if t < limit:
                one = np.uint32(1 << (t & 31))
                word = words[t >> 5]
                words[t >> 5] = word | one if (may_end and t in stops) else word & ~one


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # added to a logit whose bit is 0, 1


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [B, V] whose row rows[j] keeps the tokens whose bit is set in
    bitmask[j] (int32 words, bit t % 32 of word t // 32, llguidance's layout; tokens past the
    bitmask's width are dropped) and has -inf elsewhere.

    The bits become a bias of 0 or -inf that is added (numpy: unpack, take; ~40 us over 49k
    tokens, a third of what a boolean masked_fill costs on a CPU), so a logit that is already
    NaN stays NaN and the sampler refuses the row, as it does without a grammar."""
    out = logits.clone()
    if rows:
        words = bitmask.cpu().numpy().astype("<i4", copy=False)  # the bytes, low one first
        bits = np.unpackbits(words.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
        bias = torch.from_numpy(_BIAS.take(bits)).to(device=logits.device, dtype=logits.dtype)
        if list(rows) == list(range(logits.shape[0])):
            out += bias
        else:
            index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
            out[index] += bias
    return out
