"""/v1/responses with the real `openai` client (`responses.create`, `responses.stream`) against
the real coordinator on fake workers: text input and instructions, whole and streamed, the
event order, usage, incomplete at max_output_tokens, and the 400s naming what is refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.coordinator_fakes import (
    DEADLINE_S, Script, harness_on_thread, load_model, make_tiny_model_dir,
)

TOKENS = [200, 201, 202, 203, 204]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def live(model):
    async def setup(h):
        prefill = await h.add_worker("p1", "prefill", Script(tokens=TOKENS))
        decode = await h.add_worker("d1", "decode", Script(tokens=TOKENS, finish_reason="stop"))
        return h.url, decode, prefill

    with harness_on_thread(model, setup, prefill_threshold=10_000) as value:
        yield value


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="x", timeout=DEADLINE_S,
                         max_retries=0)


def _prompt_of_last_request(decode) -> list[int]:
    return list(decode.requests[-1].prompt_token_ids)


def test_create_answers_as_chat_completions_does(live, oai, model):
    url, decode, _ = live
    chat = oai.chat.completions.create(model="tiny", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    chat_prompt = _prompt_of_last_request(decode)
    r = oai.responses.create(model="tiny", input="Hi there", instructions="Be brief.")
    assert _prompt_of_last_request(decode) == chat_prompt  # instructions: the system message
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text"
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == len(TOKENS)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_input_as_messages_with_text_parts(live, oai):
    _, decode, _ = live
    oai.responses.create(model="tiny", input="Hi there", instructions="Be brief.")
    plain = _prompt_of_last_request(decode)
    oai.responses.create(model="tiny", input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text",
                                                               "text": "there"}]}])
    assert _prompt_of_last_request(decode) == plain


def test_stream_sends_the_events_in_order_and_the_helper_assembles_them(oai):
    whole = oai.responses.create(model="tiny", input="Hi there")
    with oai.responses.stream(model="tiny", input="Hi there") as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.status == "completed" and final.usage.output_tokens == len(TOKENS)
    # create(stream=True): the raw events, numbered in order.
    numbers = [e.sequence_number for e in oai.responses.create(model="tiny", input="Hi there",
                                                              stream=True)]
    assert numbers == list(range(len(numbers)))


def test_an_answer_cut_at_its_length_is_incomplete(model):
    # The fake worker ends at its script's length, as a real one at max_output_tokens.
    async def setup(h):
        await h.add_worker("d1", "decode", Script(tokens=TOKENS, finish_reason="length"))
        return h.url

    with harness_on_thread(model, setup, prefill_threshold=10_000) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=DEADLINE_S,
                               max_retries=0)
        r = client.responses.create(model="tiny", input="Hi there", max_output_tokens=5)
        events = list(client.responses.create(model="tiny", input="Hi there",
                                              max_output_tokens=5, stream=True))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 5 and r.usage.output_tokens == len(TOKENS)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.output[0].content[0].text == r.output_text


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]},
     "tools is not supported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id is not supported"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format is not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     'input[0]: input items of type "function_call_output" are not supported'),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]: only text parts are supported"),
    ({"input": ""}, "input must be a non-empty string"),
    ({"max_output_tokens": 0}, "max_output_tokens must be an integer between 1"),
    ({"temperature": 3}, "temperature must be a number between 0 and 2"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role must be one of"),
])
def test_refusals_are_400s_naming_the_field(live, body, message):
    r = httpx.post(live[0] + "/v1/responses", timeout=DEADLINE_S,
                   json={"model": "tiny", "input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="Hi")
