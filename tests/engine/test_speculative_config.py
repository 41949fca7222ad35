"""--speculative's parsing into SpeculativeConfig, and where it may be used."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig, parse_speculative


@pytest.mark.parametrize("text, k, lo, hi", [
    ("ngram:k=4", 4, 1, 3),
    ("ngram:k=2,n=2..5", 2, 2, 5),
    (" ngram:k=8, n=3 ", 8, 3, 3),
])
def test_valid_specs(text, k, lo, hi):
    config = parse_speculative(text)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == ("ngram", k, lo, hi)
    assert parse_speculative(config.spec) == config


@pytest.mark.parametrize("text", [None, "", "off", "none"])
def test_off(text):
    assert parse_speculative(text) is None


@pytest.mark.parametrize("text, words", [
    ("eagle:k=4", "method must be one of ngram, draft"),
    ("draft:k=4", "draft needs its model first"),
    ("draft:m", "k=N is required"),
    ("draft:m,k=2,n=1..2", "unknown option 'n'"),
    ("ngram", "k=N is required"),
    ("ngram:k=0", "1..16"),
    ("ngram:k=99", "1..16"),
    ("ngram:k=four", "integers"),
    ("ngram:k=4,n=3..1", "MIN..MAX"),
    ("ngram:k=4,n=0", "MIN..MAX"),
    ("ngram:k=4,depth=2", "unknown option 'depth'"),
    ("ngram:k", "must be k=N"),
])
def test_bad_specs_name_the_problem(text, words):
    with pytest.raises(ValueError, match="--speculative") as info:
        parse_speculative(text)
    assert words in str(info.value)


def test_prefill_engines_refuse_speculation():
    with pytest.raises(ValueError, match="prefill engine"):
        EngineConfig(role="prefill", speculative=SpeculativeConfig())
    assert EngineConfig(role="decode", speculative=SpeculativeConfig()).speculative.num_speculative_tokens == 4
