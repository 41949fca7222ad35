"""Hostile input on every client API (issue 15): option values that would break the sampler's
numerics or overflow the worker protocol, JSON nested 10,000 levels deep, invalid Unicode and
wrong types. Each is refused with a 400 in the API's own shape (INVALID_ARGUMENT on gRPC)
before it reaches a worker, nothing is logged at ERROR, and the very next normal request is
served.

One real coordinator (HTTP + gRPC) with one scripted fake decode worker, started once for the
module on a background event loop: none of these requests should ever reach a worker.
"""

from __future__ import annotations

import json
import logging

import grpc
import httpx
import pytest

from coordinator.client import TandemClient
from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, harness_on_thread, load_model, make_tiny_model_dir,
)

TEXT = "Hello world! How are you?"
USER = [{"role": "user", "content": "Tell me about the river."}]
# The payloads: each made torch.multinomial raise on nan/inf and took the cluster down.
NUMERIC = [
    ({"temperature": 1e308}, "option 'temperature' must be 0 (greedy) or between 0.0001 and 100"),
    ({"temperature": 1e-300}, "option 'temperature' must be 0 (greedy) or between"),
    ({"temperature": 1e-320}, "option 'temperature' must be 0 (greedy) or between"),
    ({"repeat_penalty": 1e-300, "temperature": 0.5},
     "option 'repeat_penalty' must be between 0.001 and 100"),
    ({"frequency_penalty": -1e308, "temperature": 0.5},
     "option 'frequency_penalty' must be between -100 and 100"),
]
OUT_OF_RANGE = [
    ({"seed": 2**63}, "option 'seed' must be a 64-bit signed integer"),
    ({"repeat_last_n": 2**63}, "option 'repeat_last_n' must be between -1 and 2147483647"),
]
DEEP = '{"a":' * 10_000 + "1" + "}" * 10_000


class Server:
    def __init__(self, url: str, grpc_target: str, decode) -> None:
        self.url, self.grpc_target, self.decode = url, grpc_target, decode

    def post(self, path: str, content: str | bytes) -> httpx.Response:
        return httpx.post(self.url + path, content=content, timeout=DEADLINE_S,
                          headers={"Content-Type": "application/json"})

    def served(self) -> int:
        return len(self.decode.requests)

    def check_still_serving(self, before: int) -> None:
        """The hostile request reached no worker, and a normal one right after is answered."""
        assert self.served() == before
        r = httpx.post(self.url + "/api/chat", timeout=DEADLINE_S, json={
            "model": "tiny", "messages": USER, "stream": False, "options": {"temperature": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["message"]["content"] == TEXT
        assert self.served() == before + 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    tokens = model.tokenizer.encode(TEXT, add_special_tokens=False)

    async def setup(h):
        decode = await h.add_worker("d1", "decode", Script(tokens=tokens))
        return Server(h.url, f"127.0.0.1:{h.coordinator.grpc_port}", decode)

    with harness_on_thread(model, setup, prefill_threshold=10_000) as server:
        yield server


@pytest.fixture(autouse=True)
def no_errors_logged(caplog):
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def ollama_body(path: str, **fields) -> str:
    base = ({"prompt": "hi"} if path == "/api/generate" else {"messages": USER})
    return json.dumps({"model": "tiny", "stream": False, **base, **fields})


def check_ollama_400(r: httpx.Response, message: str) -> None:
    assert r.status_code == 400, r.text
    assert message in r.json()["error"], r.json()
    assert "Traceback" not in r.text


def check_openai_400(r: httpx.Response, message: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error
    assert "Traceback" not in r.text


# ---- option ranges ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("options, message", NUMERIC + OUT_OF_RANGE)
def test_ollama_options_out_of_range_are_400(server, path, options, message):
    before = server.served()
    check_ollama_400(server.post(path, ollama_body(path, options=options)), message)
    server.check_still_serving(before)


OPENAI_NUMERIC = [(o, m) for o, m in NUMERIC if "repeat_penalty" not in o]  # OpenAI has none


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields, message", OPENAI_NUMERIC + [
    ({"seed": 2**63}, "option 'seed' must be a 64-bit signed integer"),
    ({"max_tokens": 2**63}, "max_tokens must be an integer between 1 and 2147483647"),
])
def test_openai_params_out_of_range_are_400(server, path, fields, message):
    base = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "hi"}
    before = server.served()
    check_openai_400(server.post(path, json.dumps({"model": "tiny", **base, **fields})), message)
    server.check_still_serving(before)


@pytest.mark.parametrize("call", ["generate", "chat"])
@pytest.mark.parametrize("options, message", NUMERIC + [
    ({"repeat_last_n": 2**31 - 1, "top_k": 2**31 - 1, "temperature": -1},
     "option 'temperature' must be 0 (greedy) or between"),
])
def test_grpc_options_out_of_range_are_invalid_argument(server, call, options, message):
    before = server.served()
    with TandemClient(server.grpc_target, timeout_s=DEADLINE_S) as client:
        with pytest.raises(grpc.RpcError) as info:
            if call == "generate":
                list(client.generate("tiny", "hi", options=options))
            else:
                list(client.chat("tiny", USER, options=options))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in info.value.details()
        assert client.chat_text("tiny", USER, options={"temperature": 0}) == TEXT
    assert server.served() == before + 1


# ---- malformed bodies ------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/v1/chat/completions",
                                  "/v1/completions", "/api/show"])
def test_json_nested_10000_deep_is_400(server, path):
    before = server.served()
    r = server.post(path, DEEP)
    (check_openai_400 if path.startswith("/v1/") else check_ollama_400)(
        r, "request body nests JSON deeper than 64 levels")
    server.check_still_serving(before)


def test_json_nested_past_the_limit_inside_tools_is_400(server):
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"x": schema}}
    r = server.post("/api/chat", ollama_body("/api/chat", tools=[{"type": "function",
                                                                 "function": {"parameters": schema}}]))
    check_ollama_400(r, "deeper than 64 levels")


def test_an_integer_of_5000_digits_is_400(server):
    r = server.post("/api/chat", '{"model": "tiny", "options": {"seed": ' + "9" * 5000 + "}}")
    check_ollama_400(r, "invalid JSON in request body")
    assert len(r.text) < 400  # the message is capped, never the number echoed


LONE = '"\\ud800"'  # valid JSON; decodes to half a UTF-16 pair, not a Unicode string


@pytest.mark.parametrize("path, template", [
    ("/api/chat", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'),
    ("/api/generate", '{"model": "tiny", "prompt": %s}'),
    ("/api/generate", '{"model": "tiny", "prompt": "hi", "system": %s}'),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'),
    ("/v1/completions", '{"model": "tiny", "prompt": %s}'),
])
def test_a_lone_surrogate_is_400(server, path, template):
    before = server.served()
    r = server.post(path, template % LONE)
    (check_openai_400 if path.startswith("/v1/") else check_ollama_400)(
        r, "invalid Unicode: a lone surrogate (U+D800)")
    server.check_still_serving(before)


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
@pytest.mark.parametrize("calls", [5, "call", [5]])
def test_tool_calls_of_the_wrong_type_are_400(server, path, calls):
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": calls}]
    before = server.served()
    r = server.post(path, json.dumps({"model": "tiny", "messages": messages, "stream": False}))
    (check_openai_400 if path.startswith("/v1/") else check_ollama_400)(
        r, "messages[1].tool_calls must be a list of objects")
    server.check_still_serving(before)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("key", ["name", "tool_call_id"])
def test_openai_message_names_of_the_wrong_type_are_400(server, path, key):
    """Found by the schemathesis fuzz test: /tokenize answered 200 for a tool_call_id object."""
    messages = [*USER, {"role": "tool", "content": "4", key: {"a": 1}}]
    before = server.served()
    r = server.post(path, json.dumps({"model": "tiny", "messages": messages}))
    check_openai_400(r, f"messages[1].{key} must be a string")
    server.check_still_serving(before)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("text", [None, 5, ["a"]])
def test_a_text_part_whose_text_is_not_a_string_is_400(server, path, text):
    """Found by the schemathesis fuzz test: a text part with "text": null was tokenized as the
    word "None"."""
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": text}]
    before = server.served()
    r = server.post(path, json.dumps({"model": "tiny", "messages": [{"role": "user",
                                                                     "content": parts}]}))
    check_openai_400(r, "messages[0].content[1].text must be a string")
    server.check_still_serving(before)


def test_tool_call_arguments_nested_10000_deep_are_400(server):
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]}]
    r = server.post("/v1/chat/completions", json.dumps({"model": "tiny", "messages": messages}))
    check_openai_400(r, "tool_calls arguments must be a JSON object")


def test_null_content_on_ollama_is_empty_as_in_ollama(server):
    # Go decodes null into "": Ollama answers, and so do we (the template never sees a hole).
    messages = [{"role": "system", "content": None}, *USER]
    r = server.post("/api/chat", json.dumps({"model": "tiny", "messages": messages,
                                             "stream": False}))
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == TEXT


def test_null_content_on_openai_is_400_unless_assistant(server):
    before = server.served()
    r = server.post("/v1/chat/completions", json.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": None}]}))
    check_openai_400(r, "messages[0].content must be a string or a list of text parts")
    assert "UndefinedError" not in r.text
    server.check_still_serving(before)
    # An assistant turn that only called a tool has null content in OpenAI's own shape.
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    r = server.post("/v1/chat/completions", json.dumps({"model": "tiny", "messages": messages}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == TEXT
