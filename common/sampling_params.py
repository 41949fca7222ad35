"""Per-request sampling options, with Ollama's names, defaults and leniencies.

Torch-free: the coordinator validates a request's `options` with `SamplingParams.from_options`
before it queues anything, so a bad option is a 400 naming the option and never reaches a worker.

Where Ollama's behaviour is surprising we keep it, because Ollama's clients rely on it, and say
so here:
- `num_predict`: -1 is unbounded (stops at the context limit), -2 ("fill the context") is the
  same thing for us, and 0 is unbounded too: Ollama's runner only stops on `numPredict > 0`.
  After construction `num_predict` is therefore either -1 or a positive limit.
- `seed`: Ollama's default is -1, meaning a random seed; any negative seed is stored as None.
- `top_p` 0 and `typical_p` 0 are accepted: llama.cpp then keeps a single token (min_keep = 1).
- `repeat_last_n` 0 turns off all three penalties, as in llama.cpp; -1 means the whole context.
- `stop`: a string or a list of strings; empty strings are dropped (they would match anywhere).
  At most MAX_STOP_STRINGS strings of at most MAX_STOP_LENGTH characters each.
- A JSON null for any option means "use the default", as Go's decoder does.

Ranges (wider than any sensible use, narrow enough that no value can make the sampler's fp32
arithmetic overflow, and every integer fits the worker protocol's fields):
- temperature: 0 (greedy), or 0.0001 to 100. Below 0.0001 is refused rather than clamped: it
  is argmax in all but name, and values such as 1e-300 become 0 in fp32 and divide by zero;
  above 100 every distribution is flat, and 1e308 becomes inf in fp32 (inf / inf = nan).
- top_p, min_p, typical_p: 0 to 1. top_k: 0 (off) to 2**31 - 1 (past the vocabulary = off).
- repeat_penalty: 0.001 to 100 (1 = off).
- presence_penalty, frequency_penalty: -100 to 100. Wider than OpenAI's -2..2, as Ollama
  passes its clients' values through; +-100 times any token count stays finite in fp32.
- seed: a signed 64-bit integer (what Ollama's Go decoder and OpenAI accept); larger ones are
  refused, not folded, so that a seed always means what the client wrote.
- repeat_last_n: -1 to 2**31 - 1; num_predict: -2 to 2**31 - 1; num_ctx, num_batch: 1 to
  2**31 - 1; num_keep: -1 to 2**31 - 1; num_thread: 0 to 2**31 - 1 (the protocol's int32).

- min_tokens: 0 to 2**31 - 1, and at most num_predict when that is set: the stop tokens are
  forbidden (their logits masked) until that many tokens exist. A tandem extension in Ollama's
  `options` (vLLM's name); stop strings still end a request early, as tandem checks them on text.
- logit_bias (OpenAI's): at most MAX_LOGIT_BIAS token ids, each bias in -100..100, added to the
  logits before the penalties; whether each id is in the vocabulary is Coordinator.prepare's
  check (it knows the model).
- speculative: true or false (a tandem extension, in Ollama's `options` and as an OpenAI
  body field): false opts the request out of speculative decoding on a worker started with
  `--speculative`; greedy output is the same either way, sampled output has the same
  distribution.
- cache: true, false or null (a tandem extension, like speculative): whether the coordinator's
  response cache may answer a sampled request (true), or none at all (false); null leaves it to
  the cache, which serves only deterministic requests.
- stop_token_ids (vLLM's): at most MAX_STOP_TOKEN_IDS ids, added to the model's stop tokens;
  ignore_eos (vLLM's): the model's end-of-text tokens do not stop the request. Both decide the
  stop set that the coordinator sends (coordinator/service.py prepare); workers never see them.

`grammar` (structured output) is no Ollama option: the APIs set it from `format` /
`response_format` / `tool_choice` (coordinator/structured_output.py), never from `options`.
GrammarSpec checks its shape here, torch- and llguidance-free; whether it compiles is
common/grammar_compile.py's `compile_error` (the coordinator asks it before admitting a request).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from common.errors import InvalidOptionError
from common.logprobs import MAX_LOGPROBS

MIN_TEMPERATURE = 1e-4  # a positive temperature below this is refused (see the ranges above)
MAX_TEMPERATURE = 100.0
MIN_REPEAT_PENALTY = 1e-3
MAX_REPEAT_PENALTY = 100.0
MAX_PENALTY = 100.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_COUNT = (1 << 31) - 1  # integer options travel as int32 (proto/worker.proto, tandem.proto)
GRAMMAR_KINDS = ("json", "json_schema", "lark", "regex")
# Stop strings: the matcher's cost per token does not depend on these (common/stop_strings.py),
# but compiling it and carrying the list on every hop does; far past any real use.
MAX_STOP_STRINGS = 256
MAX_STOP_LENGTH = 512  # characters of one stop string
# A grammar's text (a JSON schema, Lark grammar or regex). llguidance's compile over a vocabulary
# grows faster than linearly with it (SmolLM2's 49k tokens, a 2-core Xeon: a 36 KB schema of
# 1,000 properties 0.09 s, 74 KB 0.33 s, 289 KB ~20 s), and it runs once per distinct schema.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias (OpenAI's API refuses more, too)
MAX_BIAS = 100.0  # each bias lies in [-MAX_BIAS, MAX_BIAS], OpenAI's range
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, compiled by engine/grammar.py against the model's
    vocabulary. Hashable: it is the key of the compiled-grammar cache.

    kind "json": any JSON object (Ollama's `format: "json"`, OpenAI's json_object); `value`
    is unused and stored as "". "json_schema": `value` is the schema (a dict, or its JSON
    text; stored as compact JSON text, key order kept since it orders the output). "lark":
    llguidance's Lark syntax with a `start` rule. "regex": the whole output matches `value`."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidOptionError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, "
                                     f"got {_show(self.kind)}")
        value = self.value
        if self.kind == "json":
            value = ""
        elif self.kind == "json_schema":
            value = _schema_text(value)
        elif not isinstance(value, str) or not value:
            raise InvalidOptionError(f"a {self.kind} grammar must be a non-empty string, "
                                     f"got {_show(value)}")
        if len(value) > MAX_GRAMMAR_CHARS:
            raise InvalidOptionError(f"the {self.kind} grammar is {len(value)} characters "
                                     f"(limit {MAX_GRAMMAR_CHARS})")
        object.__setattr__(self, "value", value)

    @property
    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema of a json_schema grammar, else None."""
        return json.loads(self.value) if self.kind == "json_schema" else None


def _schema_text(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidOptionError("a JSON schema must be valid JSON") from None
    if value is False:
        raise InvalidOptionError("the JSON schema false accepts no value at all")
    if not isinstance(value, (dict, bool)):
        raise InvalidOptionError(f"a JSON schema must be an object (or true), got {_show(value)}")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(f"the JSON schema is not plain JSON: {exc}") from None


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy (argmax)
    top_k: int = 40  # 0 = off
    top_p: float = 0.9  # 1 = off
    min_p: float = 0.0  # 0 = off
    typical_p: float = 1.0  # 1 = off
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64  # penalty window over prompt + output; 0 = off, -1 = whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None = a fresh random seed per request
    num_predict: int = -1  # -1 = until the context limit, else the most tokens to generate
    stop: tuple[str, ...] = ()
    num_ctx: int | None = None  # the request's context window, capped by the engine's
    # Accepted for Ollama compatibility and stored; the engine sizes these itself.
    num_keep: int | None = None
    num_batch: int | None = None
    num_thread: int | None = None
    grammar: GrammarSpec | None = None  # structured output; not an Ollama option (see above)
    # Log probabilities (common/logprobs.py): None = none, else how many top alternatives to
    # report with each sampled token's (0 = the sampled token's only), 0..MAX_LOGPROBS. Set by
    # the APIs' own fields, never from Ollama's `options`.
    logprobs: int | None = None
    # Prompt log probabilities: None = none, else how many top alternatives to report with each
    # prompt token's (0..MAX_LOGPROBS). The prefill computes logits at every prompt position,
    # so such a request bypasses the prefix cache (engine/scheduler.py). Set by the APIs.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # the stop tokens are masked until this many tokens exist
    # Set by the OpenAI routes, never from `options` (see the module docstring):
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, sorted
    ignore_eos: bool = False  # the model's own stop tokens do not stop the request
    # False: this request never speculates, even on a worker started with --speculative
    # (engine/speculative.py). Greedy answers are the same either way.
    speculative: bool = True
    # The coordinator's response cache (coordinator/response_cache.py), a tandem extension in
    # Ollama's `options` and as an OpenAI body field: None serves and stores deterministic
    # requests only (greedy or seeded), true also this sampled one, false bypasses the cache.
    # Never sent to the workers, and not part of a cache key.
    cache: bool | None = None

    def __post_init__(self) -> None:
        # Type-check (and coerce 40.0 -> 40, "x" -> ("x",)) on every path, not only
        # from_options, so a SamplingParams built in code obeys the same rules.
        for name, kind in _KINDS.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            object.__setattr__(self, name, _CONVERTERS[kind](name, value))
        _check_range("temperature", self.temperature == 0
                     or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
                     f"0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}",
                     self.temperature)
        _check_count("top_k", self.top_k, 0, " (0 turns it off)")
        _check_range("top_p", 0 <= self.top_p <= 1, "between 0 and 1", self.top_p)
        _check_range("min_p", 0 <= self.min_p <= 1, "between 0 and 1", self.min_p)
        _check_range("typical_p", 0 <= self.typical_p <= 1, "between 0 and 1", self.typical_p)
        _check_range("repeat_penalty",
                     MIN_REPEAT_PENALTY <= self.repeat_penalty <= MAX_REPEAT_PENALTY,
                     f"between {MIN_REPEAT_PENALTY:g} and {MAX_REPEAT_PENALTY:g}",
                     self.repeat_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_range(name, -MAX_PENALTY <= value <= MAX_PENALTY,
                         f"between {-MAX_PENALTY:g} and {MAX_PENALTY:g}", value)
        if self.seed is not None:
            _check_range("seed", -(1 << 63) <= self.seed < (1 << 63),
                         "a 64-bit signed integer (negative = random)", self.seed)
        _check_count("repeat_last_n", self.repeat_last_n, -1, " (-1 = the whole context)")
        _check_count("num_predict", self.num_predict, -2, " (-1 = unbounded)")
        if self.num_ctx is not None:
            _check_count("num_ctx", self.num_ctx, 1)
        if self.num_keep is not None:
            _check_count("num_keep", self.num_keep, -1)
        if self.num_batch is not None:
            _check_count("num_batch", self.num_batch, 1)
        if self.num_thread is not None:
            _check_count("num_thread", self.num_thread, 0, " (0 = automatic)")
        # Normalise Ollama's aliases so that consumers test one value (see the module docstring).
        if self.num_predict in (0, -2):
            object.__setattr__(self, "num_predict", -1)
        if self.seed is not None and self.seed < 0:
            object.__setattr__(self, "seed", None)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _to_int(name, value)
                object.__setattr__(self, name, value)
                _check_range(name, 0 <= value <= MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}", value)
        _check_count("min_tokens", self.min_tokens, 0)
        if 0 < self.num_predict < self.min_tokens:
            raise InvalidOptionError(f"option 'min_tokens' ({self.min_tokens}) is more than "
                                     f"num_predict ({self.num_predict})")
        object.__setattr__(self, "logit_bias", _to_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", _to_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidOptionError(f"ignore_eos must be true or false, "
                                     f"got {_show(self.ignore_eos)}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidOptionError(f"grammar must be a GrammarSpec, got {_show(self.grammar)}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, *,
                     warn: Callable[[str], None] | None = None) -> SamplingParams:
        """Build from an Ollama `options` object, type-checking every known key.

        Unknown keys (including Ollama options tandem does not implement, such as `mirostat`)
        are ignored, each reported once through `warn`.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidOptionError(f"options must be an object, got {_show(options)}")
        values: dict[str, Any] = {}
        for key, raw in options.items():
            kind = _KINDS.get(key)
            if kind is None:
                if warn is not None:
                    warn(f"unknown option {key!r} ignored")
                continue
            if raw is not None:
                values[key] = raw
        return cls(**values)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax, so no random draw is needed."""
        return self.temperature == 0 or self.top_k == 1

    def context_limit(self, context_len: int) -> int:
        """The request's context window: the engine's, narrowed by `num_ctx` when given."""
        return context_len if self.num_ctx is None else min(context_len, self.num_ctx)

    def max_tokens_for(self, prompt_len: int, context_len: int) -> int:
        """How many tokens this request may generate after a `prompt_len`-token prompt in an
        engine whose context is `context_len` tokens. 0 when the prompt already fills it."""
        room = max(0, self.context_limit(context_len) - prompt_len)
        return room if self.num_predict < 0 else min(self.num_predict, room)


def _show(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 200:
        # repr of a huge int is slow, and past 4,300 digits Python refuses to make it.
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise InvalidOptionError(f"option {name!r} must be a finite number, got {_show(value)}")


def _check_range(name: str, ok: bool, expected: str, value: Any) -> None:
    if not ok:
        raise InvalidOptionError(f"option {name!r} must be {expected}, got {_show(value)}")


def _check_count(name: str, value: int, low: int, note: str = "") -> None:
    _check_range(name, low <= value <= MAX_COUNT, f"between {low} and {MAX_COUNT}{note}", value)


def _to_int(name: str, value: Any) -> int:
    # bool is an int subclass in Python; JSON true is never a count.
    if isinstance(value, bool):
        raise InvalidOptionError(f"option {name!r} must be an integer, got {_show(value)}")
    if isinstance(value, int):
        return value
    # JSON has one number type and some clients send 40.0; only a whole number is an integer.
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise InvalidOptionError(f"option {name!r} must be an integer, got {_show(value)}")


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidOptionError(f"option {name!r} must be a number, got {_show(value)}")
    result = float(value)
    _check_finite(name, result)
    return result


def _to_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"option {name!r} must be true or false, got {_show(value)}")
    return value


def _to_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_STOP_STRINGS:
            raise InvalidOptionError(f"option {name!r} takes at most {MAX_STOP_STRINGS} strings, "
                                     f"got {len(value)}")
        if all(isinstance(s, str) for s in value):
            longest = max(map(len, value), default=0)
            if longest > MAX_STOP_LENGTH:
                raise InvalidOptionError(f"option {name!r}: each stop string may have at most "
                                         f"{MAX_STOP_LENGTH} characters, got one of {longest}")
            return tuple(value)
    raise InvalidOptionError(f"option {name!r} must be a string or a list of strings, "
                             f"got {_show(value)}")


def _to_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A {token id: bias} mapping (ids as ints or, from JSON, as decimal strings) or pairs ->
    (id, bias) pairs sorted by id."""
    if isinstance(value, Mapping):
        value = list(value.items())
    if not isinstance(value, (list, tuple)):
        raise InvalidOptionError(f"logit_bias must map token ids to numbers, got {_show(value)}")
    out: dict[int, float] = {}
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise InvalidOptionError(f"logit_bias must map token ids to numbers, got {_show(item)}")
        key, bias = item
        digits = isinstance(key, str) and key.isascii() and key.isdigit()
        token = _token_id("logit_bias", int(key) if digits else key)
        bias = _to_float(f"logit_bias[{token}]", bias)
        _check_range(f"logit_bias[{token}]", -MAX_BIAS <= bias <= MAX_BIAS,
                     f"between {-MAX_BIAS:g} and {MAX_BIAS:g}", bias)
        out[token] = bias
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidOptionError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, "
                                 f"got {len(out)}")
    return tuple(sorted(out.items()))


def _to_token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple, frozenset, set)):
        raise InvalidOptionError(f"stop_token_ids must be a list of token ids, got {_show(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidOptionError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                                 f"got {len(value)}")
    return tuple(sorted({_token_id("stop_token_ids", t) for t in value}))


def _token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise InvalidOptionError(f"{name}: a token id must be an integer between 0 and "
                                 f"{MAX_COUNT}, got {_show(value)}")
    return value


_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    "int": _to_int, "float": _to_float, "stop": _to_stop, "bool": _to_bool}


def _kind(annotation: str) -> str:
    if annotation.startswith("int"):
        return "int"
    if annotation == "float":
        return "float"
    if annotation in ("bool", "bool | None"):
        return "bool"
    return "stop"


# Field annotations are strings under `from __future__ import annotations`. These are set by
# the APIs, never from Ollama's `options`:
_API_ONLY = ("grammar", "logprobs", "prompt_logprobs", "logit_bias", "stop_token_ids",
             "ignore_eos")
_KINDS: dict[str, str] = {f.name: _kind(str(f.type)) for f in fields(SamplingParams)
                          if f.name not in _API_ONLY}
# The names Ollama's `options` (and a model's default options) may carry.
OPTION_NAMES: frozenset[str] = frozenset(_KINDS)
_OPTIONAL: frozenset[str] = frozenset(
    f.name for f in fields(SamplingParams) if str(f.type).endswith("| None"))
