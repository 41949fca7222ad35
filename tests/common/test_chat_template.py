"""Chat templates render as transformers renders them, and give llama.cpp's prompt ids."""

from __future__ import annotations

import json

import pytest

from common.chat_template import CHATML_TEMPLATE, render_chat
from common.errors import ChatTemplateError, InvalidOptionError
from common.tokenizer import Tokenizer

# Exercises what real templates use: whitespace control, trim/lstrip blocks, namespace, loop
# controls, tojson with indent, dict(), bos/eos variables, raise_exception, and optional keys.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none, n=0) %}
{%- if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}
{% if tools %}
<tools>
  {% for tool in tools %}
  {{ tool | tojson(indent=2) }}
  {% endfor %}
</tools>
{% endif %}
{% for message in messages %}
  {% if message.role == 'system' %}{% continue %}{% endif %}
  {% if message.role not in ['user', 'assistant', 'tool'] %}
    {{ raise_exception('unknown role ' + message.role) }}
  {% endif %}
  {% set ns.n = ns.n + 1 %}
<|{{ message.role }}|>{% if ns.system and loop.first %}[{{ ns.system }}]{% endif %}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{% if message.content is defined %}{{ message.content }}{% else %}(no content){% endif %}
{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}
{{ eos_token }}
  {% if ns.n >= max_turns | default(99) %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{{ dict(a=1) | tojson }}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» & <escaped>?",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2? 模型 😀"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "calc", "arguments": {"x": "2+2"}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "  spaces\n\nand newlines  "},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """transformers' PreTrainedTokenizerFast around a trivial vocab: its renderer is the oracle."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def _ours(template, messages, **kwargs):
    return render_chat(template, messages, bos_token="<s>", eos_token="</s>", **kwargs)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rich_template_matches_transformers(hf_tokenizer, messages, add_generation_prompt, tools):
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    got = _ours(RICH_TEMPLATE, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert "&lt;" not in got  # HF's tojson does not HTML-escape


def test_extra_variables_reach_the_template_like_transformers(hf_tokenizer):
    messages = CONVERSATIONS[1]
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, add_generation_prompt=True, tokenize=False, max_turns=2
    )
    got = _ours(RICH_TEMPLATE, messages, add_generation_prompt=True, max_turns=2)
    assert got == expected
    assert got.count("</s>") == 2


def test_missing_template_is_chatml():
    hi = [{"role": "user", "content": "hi"}]
    got = render_chat(None, hi, add_generation_prompt=True, bos_token=None, eos_token=None)
    assert got == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    got = render_chat(CHATML_TEMPLATE, hi, add_generation_prompt=False, bos_token=None, eos_token=None)
    assert got == "<|im_start|>user\nhi<|im_end|>\n"


def test_caller_messages_are_not_modified():
    messages = [{"role": "assistant", "content": None, "reasoning_content": "r"}]
    before = json.dumps(messages)
    _ours(RICH_TEMPLATE, messages, add_generation_prompt=False)
    assert json.dumps(messages) == before


def test_template_errors_are_ours():
    with pytest.raises(ChatTemplateError, match="parse"):
        _ours("{% for m in messages %}{{ m.content }}", [{"role": "user", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="unknown role wizard"):
        _ours(RICH_TEMPLATE, [{"role": "wizard", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        _ours("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}], add_generation_prompt=True)
    with pytest.raises(ChatTemplateError):  # a runtime failure inside the template: str + list
        _ours(CHATML_TEMPLATE, [{"role": "user", "content": ["a"]}], add_generation_prompt=True)
    assert issubclass(ChatTemplateError, InvalidOptionError)


def test_bad_messages_and_tools_rejected():
    with pytest.raises(InvalidOptionError):
        _ours(CHATML_TEMPLATE, [], add_generation_prompt=True)
    with pytest.raises(InvalidOptionError):
        _ours(CHATML_TEMPLATE, ["hi"], add_generation_prompt=True)
    with pytest.raises(InvalidOptionError):
        _ours(CHATML_TEMPLATE, [{"role": "user", "content": "x"}], add_generation_prompt=True, tools=["f"])


# ---- the default model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


@pytest.mark.model
def test_gguf_template_gives_llamacpp_prompt_ids(smollm, greedy_oracle):
    for row in greedy_oracle:
        rendered = smollm.apply_chat_template(row["messages"], add_generation_prompt=True)
        assert smollm.encode(rendered, add_special_tokens=True) == row["prompt_ids"]


@pytest.mark.model
def test_gguf_template_matches_transformers(smollm, hf_tokenizer):
    messages = CONVERSATIONS[1][:2] + [{"role": "assistant", "content": "ok"}]
    for msgs in (CONVERSATIONS[0], messages):
        expected = hf_tokenizer.apply_chat_template(
            msgs, chat_template=smollm.chat_template, add_generation_prompt=True, tokenize=False
        )
        assert smollm.apply_chat_template(msgs) == expected
