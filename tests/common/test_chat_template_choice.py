"""Which chat template a model renders (common/chat_template_choice.py): the tools template
shipped for SmolLM2, matched by its own template's digest; --chat-template files; templates
stored by /api/create."""

from __future__ import annotations

import hashlib
import json

import pytest

from common.chat_template import render_chat
from common.chat_template_choice import (
    choose_template, read_template_file, shipped_for, shipped_template,
)
from common.errors import ChatTemplateError
from common.model_store import REGISTRY

# SmolLM2-135M-Instruct's own template, as its GGUF carries it (the digest below pins it to
# the one the known-models list records, so this is the real text, not a look-alike).
SMOLLM2_OWN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "system", "content": "late"}, {"role": "assistant", "content": ""}],
]


def render(template, messages, tools=None, generation=True):
    return render_chat(template, messages, add_generation_prompt=generation,
                       bos_token="<|im_start|>", eos_token="<|im_end|>", tools=tools)


def test_the_shipped_template_stands_in_for_smollm2s_own_only():
    entry = REGISTRY["smollm2"]
    assert hashlib.sha256(SMOLLM2_OWN.encode()).hexdigest() == entry.own_template_sha256
    assert shipped_for(SMOLLM2_OWN) == entry.tools_template == "smollm2_tools.jinja"
    assert shipped_for(SMOLLM2_OWN.replace("SmolLM", "SmolLm")) is None  # one byte differs
    assert shipped_for(None) is None and shipped_for("") is None


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
def test_without_tools_it_renders_what_smollm2s_own_template_renders(messages, generation):
    shipped = shipped_template("smollm2_tools.jinja")
    assert render(shipped, messages, generation=generation) == \
        render(SMOLLM2_OWN, messages, generation=generation)


def test_with_tools_it_lists_them_and_renders_calls_and_results_hermes_style():
    shipped = shipped_template("smollm2_tools.jinja")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C"},
    ]
    text = render(shipped, messages, tools=[WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(listed) == WEATHER
    assert "<tool_call>\n{\"name\": <function-name>" in system  # the format it is taught
    assert rest == ('<|im_start|>user\nWeather in Paris?<|im_end|>\n'
                    '<|im_start|>assistant\n<tool_call>\n'
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call><|im_end|>\n'
                    '<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n'
                    '<|im_start|>assistant\n')
    # A system message of the chat's own replaces the default one; the tools still follow it.
    own = render(shipped, [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "x"}], tools=[WEATHER])
    assert own.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_choice_order_flag_then_stored_then_shipped_then_own(tmp_path):
    flag = tmp_path / "mine.jinja"
    flag.write_text("{{ messages[0]['content'] }}{{ tools }}")
    assert choose_template(SMOLLM2_OWN, flag, "{{ 'stored' }}").source == f"flag {flag}"
    assert choose_template(SMOLLM2_OWN, None, "{{ 'stored' }}").template == "{{ 'stored' }}"
    shipped = choose_template(SMOLLM2_OWN)
    assert (shipped.source, shipped.template) == ("shipped smollm2_tools.jinja",
                                                  shipped_template("smollm2_tools.jinja"))
    other = "{{ messages[0]['content'] }}"
    assert choose_template(other) == choose_template(other, None, None)
    assert choose_template(other).template == other and choose_template(other).source == "model"
    assert choose_template(None).template is None


def test_bad_template_files_are_refused_naming_the_file_and_why(tmp_path):
    with pytest.raises(ChatTemplateError, match="cannot read it"):
        read_template_file(tmp_path / "missing.jinja")
    go = tmp_path / "ollama.tmpl"
    go.write_text("{{ if .System }}<|im_start|>system\n{{ .System }}{{ end }}")
    with pytest.raises(ChatTemplateError, match=f"{go}: the chat template looks like an Ollama "
                                                "Go template"):
        read_template_file(go)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        read_template_file(broken)
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ChatTemplateError, match="non-empty"):
        read_template_file(empty)
