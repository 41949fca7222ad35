"""How the embedding routes tokenize a text input (coordinator/embedding_routes.py _token_ids):
an embedder's end-of-text token ends it, and a cut to the context keeps that token, where a
last-pooled embedder (Qwen3-Embedding) reads its vector."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.tokenizer import Tokenizer
from coordinator.embedding_routes import _token_ids
from tests.common.test_tokenizer import _tiny_bpe_meta


def _model(add_eos: bool) -> SimpleNamespace:
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**{"tokenizer.ggml.add_eos_token": add_eos}))
    return SimpleNamespace(tokenizer=tok, config=SimpleNamespace(vocab_size=tok.vocab_size))


def test_a_text_ends_with_the_end_token_and_a_cut_keeps_it():
    model = _model(add_eos=True)
    abc = model.tokenizer.token_to_id("abc")
    assert _token_ids(model, ["abc abc abc"], 16, True)[0][-1] == 1
    cut = _token_ids(model, ["abc" * 10], 4, True)[0]
    assert cut == [0, abc, abc, 1]  # BOS, the text cut, the end token
    assert _token_ids(model, [[abc] * 6], 4, True)[0] == [abc] * 4  # token ids: as given, cut
    plain = _model(add_eos=False)
    assert _token_ids(plain, ["abc" * 10], 4, True)[0] == [0, abc, abc, abc]


def test_without_truncate_a_long_input_is_refused():
    from common.errors import ContextLengthError

    with pytest.raises(ContextLengthError):
        _token_ids(_model(add_eos=True), ["abc" * 10], 4, False)
