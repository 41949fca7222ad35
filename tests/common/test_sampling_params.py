import pytest

from common.errors import InvalidOptionError
from common.sampling_params import SamplingParams


def test_defaults_match_ollama():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.9, 0.0, 1.0)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.0, 64)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert p.seed is None and p.num_predict == -1 and p.stop == () and p.num_ctx is None
    assert (p.num_keep, p.num_batch, p.num_thread) == (None, None, None)
    assert SamplingParams.from_options(None) == p
    assert SamplingParams.from_options({}) == p
    assert not p.greedy


def test_from_options_reads_every_known_key():
    options = {"temperature": 0.2, "top_k": 7, "top_p": 0.5, "min_p": 0.05, "typical_p": 0.7,
               "repeat_penalty": 1.1, "repeat_last_n": -1, "presence_penalty": 0.3,
               "frequency_penalty": -0.2, "seed": 42, "num_predict": 12, "stop": ["\n", "END"],
               "num_ctx": 1024, "num_keep": 4, "num_batch": 256, "num_thread": 2}
    p = SamplingParams.from_options(options)
    for key, value in options.items():
        assert getattr(p, key) == (tuple(value) if key == "stop" else value), key


def test_number_coercions():
    p = SamplingParams.from_options({"top_k": 40.0, "temperature": 1, "num_predict": 5.0})
    assert p.top_k == 40 and type(p.top_k) is int
    assert p.temperature == 1.0 and type(p.temperature) is float
    assert p.num_predict == 5 and type(p.num_predict) is int


@pytest.mark.parametrize("key, value, words", [
    ("top_k", "abc", "must be an integer, got 'abc'"),
    ("top_k", 1.5, "must be an integer"),
    ("top_k", True, "must be an integer"),
    ("seed", 3.25, "must be an integer"),
    ("num_ctx", "2048", "must be an integer"),
    ("repeat_last_n", [64], "must be an integer"),
    ("num_keep", False, "must be an integer"),
    ("num_batch", 1e400, "must be an integer"),
    ("num_thread", {}, "must be an integer"),
    ("num_predict", "x", "must be an integer"),
    ("temperature", "hot", "must be a number"),
    ("temperature", True, "must be a number"),
    ("top_p", "0.9", "must be a number"),
    ("min_p", [0.1], "must be a number"),
    ("typical_p", "1", "must be a number"),
    ("repeat_penalty", {}, "must be a number"),
    ("presence_penalty", float("nan"), "must be a finite number"),
    ("frequency_penalty", float("inf"), "must be a finite number"),
    ("stop", 5, "must be a string or a list of strings"),
    ("stop", ["a", 1], "must be a string or a list of strings"),
    ("stop", {"a": 1}, "must be a string or a list of strings"),
])
def test_bad_types_name_the_option(key, value, words):
    with pytest.raises(InvalidOptionError) as info:
        SamplingParams.from_options({key: value})
    assert f"option {key!r}" in str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("temperature", -0.1), ("top_k", -1), ("top_p", -0.01), ("top_p", 1.01),
    ("min_p", -0.1), ("min_p", 1.5), ("typical_p", -0.5), ("typical_p", 2.0),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_last_n", -2),
    ("num_predict", -3), ("num_ctx", 0), ("num_keep", -2), ("num_batch", 0), ("num_thread", -1),
    # Values that pass a plain sign check but overflow the sampler's fp32 arithmetic or the
    # worker protocol's integer fields (issue 15).
    ("temperature", 1e308), ("temperature", 1e-300), ("temperature", 1e-320),
    ("temperature", 100.5), ("temperature", 5e-5), ("repeat_penalty", 1e-300),
    ("repeat_penalty", 1e308), ("frequency_penalty", -1e308), ("frequency_penalty", 100.5),
    ("presence_penalty", -101), ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 2**300),
    ("repeat_last_n", 2**63), ("top_k", 2**31), ("num_predict", 2**31), ("num_ctx", 2**40),
    ("num_keep", 2**31), ("num_batch", 2**31), ("num_thread", 2**31),
])
def test_out_of_range_names_the_option(key, value):
    with pytest.raises(InvalidOptionError, match=f"option '{key}' must be"):
        SamplingParams.from_options({key: value})
    with pytest.raises(InvalidOptionError, match=f"option '{key}'"):
        SamplingParams(**{key: value})


def test_range_messages_name_the_range():
    with pytest.raises(InvalidOptionError) as info:
        SamplingParams.from_options({"temperature": 1e308})
    assert str(info.value) == ("option 'temperature' must be 0 (greedy) or between 0.0001 and "
                               "100, got 1e+308")
    with pytest.raises(InvalidOptionError) as info:
        SamplingParams.from_options({"seed": 10**5000})
    assert "64-bit signed integer" in str(info.value) and "16610 bits" in str(info.value)
    with pytest.raises(InvalidOptionError, match="between -1 and 2147483647"):
        SamplingParams.from_options({"repeat_last_n": 2**63})


def test_range_edges_accepted():
    lows = SamplingParams(temperature=1e-4, repeat_penalty=1e-3, presence_penalty=-100,
                          frequency_penalty=-100, seed=-2**63, top_k=2**31 - 1,
                          repeat_last_n=2**31 - 1, num_predict=2**31 - 1)
    assert lows.temperature == 1e-4 and lows.seed is None
    highs = SamplingParams(temperature=100, repeat_penalty=100, presence_penalty=100,
                           frequency_penalty=100, seed=2**63 - 1)
    assert highs.seed == 2**63 - 1


def test_direct_construction_is_type_checked():
    with pytest.raises(InvalidOptionError, match="option 'top_k' must be an integer"):
        SamplingParams(top_k="5")
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_edges_accepted(value):
    p = SamplingParams.from_options({"top_p": value, "typical_p": value, "min_p": value,
                                     "temperature": value})
    assert p.top_p == value and p.typical_p == value and p.min_p == value


def test_unknown_keys_are_warned_and_ignored():
    warnings: list[str] = []
    p = SamplingParams.from_options({"mirostat": 2, "top_k": 3, "bogus": "x"},
                                    warn=warnings.append)
    assert p.top_k == 3
    assert warnings == ["unknown option 'mirostat' ignored", "unknown option 'bogus' ignored"]
    # No callback: still ignored, never an error.
    assert SamplingParams.from_options({"bogus": 1}) == SamplingParams()


def test_null_means_default():
    p = SamplingParams.from_options({"temperature": None, "seed": None, "stop": None})
    assert p == SamplingParams()


def test_options_must_be_an_object():
    with pytest.raises(InvalidOptionError, match="options must be an object"):
        SamplingParams.from_options(["top_k", 3])


def test_stop_string_or_list():
    assert SamplingParams.from_options({"stop": "###"}).stop == ("###",)
    assert SamplingParams.from_options({"stop": ["a", "b"]}).stop == ("a", "b")
    assert SamplingParams.from_options({"stop": []}).stop == ()
    # An empty stop string would match at every position; it is dropped.
    assert SamplingParams.from_options({"stop": ["", "x"]}).stop == ("x",)


def test_ollama_aliases_are_normalised():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=0).seed == 0
    assert SamplingParams(num_predict=-2).num_predict == -1
    # Ollama's runner stops only on num_predict > 0, so 0 is unbounded there and here.
    assert SamplingParams(num_predict=0).num_predict == -1


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=0).greedy
    assert not SamplingParams(temperature=0.01, top_k=2).greedy


def test_max_tokens_for():
    assert SamplingParams().max_tokens_for(100, 2048) == 1948
    assert SamplingParams(num_predict=10).max_tokens_for(100, 2048) == 10
    assert SamplingParams(num_predict=10).max_tokens_for(2045, 2048) == 3
    assert SamplingParams().max_tokens_for(3000, 2048) == 0
    # num_ctx narrows the engine's window but never widens it.
    assert SamplingParams(num_ctx=512).max_tokens_for(100, 2048) == 412
    assert SamplingParams(num_ctx=8192).max_tokens_for(100, 2048) == 1948
    assert SamplingParams(num_ctx=512, num_predict=1000).context_limit(2048) == 512


def test_frozen_and_hashable():
    p = SamplingParams(stop=["x"])
    with pytest.raises(AttributeError):
        p.top_k = 3  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("x",)))


def test_module_is_torch_free():
    import subprocess
    import sys

    code = "import sys, common.sampling_params, engine.block_manager; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_grammar_spec_checks_its_shape_and_travels_on_the_wire():
    from common.sampling_params import GrammarSpec
    from common.wire import sampling_from_proto, sampling_to_proto

    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.value == '{"type":"object","properties":{"b":{},"a":{}}}'  # key order kept
    assert spec == GrammarSpec("json_schema", ' {"type": "object", "properties": {"b": {}, "a": {}}}')
    assert GrammarSpec("json", "ignored").value == ""
    for kind, value, message in [
        ("yaml", "x", "grammar kind must be one of"),
        ("ebnf", 'root ::= "a"', "grammar kind must be one of"),  # Lark is the grammar syntax
        ("json_schema", "{not json", "must be valid JSON"),
        ("json_schema", [1], "must be an object"),
        ("json_schema", False, "accepts no value"),
        ("lark", "", "non-empty string"),
        ("regex", 3, "non-empty string"),
        ("regex", "a" * (1 << 21), r"characters \(limit"),
    ]:
        with pytest.raises(InvalidOptionError, match=message):
            GrammarSpec(kind, value)
    with pytest.raises(InvalidOptionError, match="must be a GrammarSpec"):
        SamplingParams(grammar="json")  # type: ignore[arg-type]
    # Never an Ollama option: `format` and `response_format` set it.
    assert SamplingParams.from_options({"grammar": "json"}).grammar is None

    params = SamplingParams(temperature=0, grammar=spec)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).grammar is None


def test_stop_lists_are_bounded_before_any_work():
    from common.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

    assert SamplingParams(stop=["s"] * MAX_STOP_STRINGS).stop  # at the limit: accepted
    with pytest.raises(InvalidOptionError, match=f"at most {MAX_STOP_STRINGS} strings, got 110000"):
        SamplingParams.from_options({"stop": [f"s{i}" for i in range(110_000)]})
    with pytest.raises(InvalidOptionError, match=f"at most {MAX_STOP_LENGTH} characters"):
        SamplingParams.from_options({"stop": ["x" * (MAX_STOP_LENGTH + 1)]})


def test_token_controls_are_normalised():
    p = SamplingParams(logit_bias={"9": 100, 3: -2.5}, stop_token_ids=[7, 2, 7], min_tokens=4.0)
    assert p.logit_bias == ((3, -2.5), (9, 100.0)) and p.stop_token_ids == (2, 7)
    assert p.min_tokens == 4 and not p.ignore_eos
    assert SamplingParams.from_options({"min_tokens": 3}).min_tokens == 3  # a tandem extension
    for field in ("logit_bias", "stop_token_ids", "ignore_eos"):  # set by the APIs only
        ignored = SamplingParams.from_options({field: [1]})
        assert getattr(ignored, field) == getattr(SamplingParams(), field)


@pytest.mark.parametrize("values,message", [
    ({"logit_bias": {"x": 1}}, "logit_bias: a token id must be an integer"),
    ({"logit_bias": {"1": 100.5}}, "'logit_bias[1]' must be between -100 and 100"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300 token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids: a token id must be"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"min_tokens": -1}, "'min_tokens' must be between 0"),
    ({"min_tokens": 9, "num_predict": 8}, "'min_tokens' (9) is more than num_predict (8)"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
])
def test_token_controls_out_of_range_are_refused_by_name(values, message):
    with pytest.raises(InvalidOptionError) as info:
        SamplingParams(**values)
    assert message in str(info.value)


def test_speculative_opt_out_is_a_checked_option_that_travels_on_the_wire():
    from common.wire import sampling_from_proto, sampling_to_proto

    assert SamplingParams().speculative is True
    off = SamplingParams.from_options({"speculative": False, "temperature": 0})
    assert off.speculative is False
    assert sampling_from_proto(sampling_to_proto(off)) == off
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).speculative is True
    with pytest.raises(InvalidOptionError, match="'speculative' must be true or false"):
        SamplingParams.from_options({"speculative": "no"})
