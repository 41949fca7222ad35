"""A model's default options and system prompt in each API's request parsing and in /api/show,
as Ollama applies them: under the request's options on /api/chat and /api/generate; under
OpenAI's always-sent temperature and top_p on /v1 (Ollama's OpenAI layer feeds the same
handlers); the system prompt unless the request brings its own."""

from __future__ import annotations

import pytest

from common.errors import InvalidOptionError
from common.model_defaults import ModelDefaults
from coordinator import model_info
from coordinator import openai_api as oa
from coordinator.model import load_served_model
from coordinator.ollama_request import parse_chat, parse_generate
from coordinator.responses_api import parse_responses

DEFAULTS = ModelDefaults.from_layers({"stop": ["END"], "temperature": 0.25, "top_k": 7,
                                      "num_predict": 3}, "Be brief.", "manifest")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_ollama_requests_take_the_model_defaults_under_their_own_options():
    req = parse_chat(CHAT, 10, DEFAULTS)
    p = req.params
    assert (p.temperature, p.top_k, p.num_predict, p.stop) == (0.25, 7, 3, ("END",))
    p = parse_chat({**CHAT, "options": {"temperature": 0, "num_predict": 9}}, 10, DEFAULTS).params
    assert (p.temperature, p.top_k, p.num_predict) == (0.0, 7, 9)
    assert parse_chat(CHAT, 10).params.top_k == 40  # no defaults: Ollama's own
    with pytest.raises(InvalidOptionError, match="options must be an object"):
        parse_chat({**CHAT, "options": [1]}, 10, DEFAULTS)


def test_generate_takes_the_model_system_unless_it_sends_one():
    body = {"model": "tiny", "prompt": "hi"}
    assert parse_generate(body, DEFAULTS).system == "Be brief."
    assert parse_generate({**body, "system": "mine"}, DEFAULTS).system == "mine"
    assert parse_generate(body).system is None
    assert parse_generate(body, DEFAULTS).params.num_predict == 3


def test_openai_requests_keep_openai_temperature_and_top_p_over_the_model():
    body = {"model": "tiny", "messages": CHAT["messages"]}
    p = oa.parse_chat_completion(body, 10, DEFAULTS).params
    assert (p.temperature, p.top_p, p.top_k, p.num_predict, p.stop) == (1.0, 1.0, 7, 3, ("END",))
    p = oa.parse_chat_completion({**body, "stop": "x", "max_tokens": 5, "temperature": 0},
                                 10, DEFAULTS).params
    assert (p.temperature, p.num_predict, p.stop) == (0.0, 5, ("x",))
    assert oa.parse_chat_completion(body, 10).params.top_k == 0  # OpenAI has no top_k
    p = oa.parse_completion({"model": "tiny", "prompt": "hi"}, DEFAULTS).params
    assert (p.temperature, p.top_k, p.num_predict) == (1.0, 7, 3)
    p = parse_responses({"model": "tiny", "input": "hi"}, 10, DEFAULTS).params
    assert (p.temperature, p.top_k, p.stop) == (1.0, 7, ("END",))


def test_show_lists_the_default_parameters_and_system(tmp_path):
    from reliability.model_factory import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf").path
    model = load_served_model(gguf, "tiny", defaults=DEFAULTS)
    body = model_info.show_body(model, model_info.describe(model))
    assert body["system"] == "Be brief."
    assert body["parameters"].splitlines() == [
        f"{'stop':<30} \"END\"", f"{'temperature':<30} 0.25", f"{'top_k':<30} 7",
        f"{'num_predict':<30} 3"]
    assert body["modelfile"].splitlines()[1:4] == ["FROM tiny:latest", 'SYSTEM """Be brief."""',
                                                  "PARAMETER stop END"]
    plain = load_served_model(gguf, "tiny")
    body = model_info.show_body(plain, model_info.describe(plain))
    assert "system" not in body and body["parameters"].startswith("stop ")
