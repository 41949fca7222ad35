"""Tokenizer: llama.cpp's ids for the default GGUF, transformers' for an HF directory, and the
SentencePiece path against a reference of the algorithm llama.cpp runs."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from common.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf)


def test_streaming_modules_never_import_torch():
    # The coordinator imports these and must stay free of torch (and of transformers).
    code = (
        "import sys, common.tokenizer, common.chat_template, common.detokenizer, common.stop_strings; "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- the default model against llama.cpp ----------------------------------------------------------


@pytest.mark.model
def test_fuzz_corpus_ids_equal_llamacpp(smollm, tokenizer_oracle):
    rows = tokenizer_oracle
    mismatches = [r["text"] for r in rows if smollm.encode(r["text"], add_special_tokens=False) != r["ids"]]
    assert mismatches == []


@pytest.mark.model
def test_fuzz_corpus_round_trips(smollm, tokenizer_oracle):
    for row in tokenizer_oracle:
        assert smollm.decode(smollm.encode(row["text"], add_special_tokens=False)) == row["text"]


@pytest.mark.model
def test_smollm_metadata(smollm):
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == smollm.token_to_id("<|im_start|>") == 1
    assert smollm.eos_token_id == smollm.token_to_id("<|im_end|>") == 2
    # <|endoftext|> (0) is a control token llama.cpp also treats as end of generation.
    assert smollm.stop_token_ids == frozenset({0, 2})
    assert smollm.add_bos is False  # the GGUF says so; the chat template writes <|im_start|> itself
    assert smollm.id_to_token(2) == "<|im_end|>"
    assert "<|im_start|>" in smollm.chat_template


@pytest.mark.model
def test_digits_split_one_by_one_and_special_text_parsed(smollm):
    ids = smollm.encode("12345", add_special_tokens=False)
    assert [smollm.decode([i]) for i in ids] == list("12345")
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2


@pytest.mark.model
def test_skip_special_tokens_on_decode(smollm):
    ids = smollm.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    assert smollm.decode(ids, skip_special_tokens=True) == "assistant\nHi there"


@pytest.mark.model
def test_bad_ids_and_text_raise_our_errors(smollm):
    from common.errors import InvalidOptionError

    with pytest.raises(InvalidOptionError, match="49152"):
        smollm.decode([5, 49152])
    with pytest.raises(InvalidOptionError):
        smollm.decode([-1])
    with pytest.raises(InvalidOptionError):
        smollm.id_to_token(10**6)
    with pytest.raises(InvalidOptionError):
        smollm.encode(b"bytes")  # type: ignore[arg-type]


# ---- BOS rule -------------------------------------------------------------------------------------


def _tiny_bpe_meta(**overrides) -> dict:
    """A byte-level vocab: the 256 byte symbols, two merges, and control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<s>", "</s>", "<|eot_id|>", *alphabet, "ab", "abc"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["a b", "ab c"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(overrides)
    return meta


def test_bos_added_once_and_only_when_asked():
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_meta())
    abc = tok.token_to_id("abc")
    assert tok.encode("abc") == [0, abc]
    assert tok.encode("<s>abc") == [0, abc]  # already starts with BOS: not doubled
    assert tok.encode("abc", add_special_tokens=False) == [abc]
    assert tok.stop_token_ids == frozenset({1, 2})  # eos + <|eot_id|>
    no_bos = Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("abc") == [abc]


def test_an_embedding_input_ends_with_eos_when_the_gguf_asks():
    """`tokenizer.ggml.add_eos_token` (Qwen3-Embedding's GGUF sets it: its vector is read at
    that EOS): an embedding input ends with EOS, as llama.cpp and Ollama embed; a chat or
    completion prompt never does (it would end the answer before it starts)."""
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**{"tokenizer.ggml.add_eos_token": True}))
    abc = tok.token_to_id("abc")
    assert tok.end_token_id == 1
    assert tok.encode("abc", embedding=True) == [0, abc, 1]
    assert tok.encode("abc</s>", embedding=True) == [0, abc, 1, 1]  # appended whatever the text, as llama.cpp
    assert tok.encode("abc") == [0, abc]  # a prompt
    assert tok.encode("abc", add_special_tokens=False, embedding=True) == [abc]
    plain = Tokenizer.from_gguf_metadata(_tiny_bpe_meta())
    assert plain.end_token_id is None and plain.encode("abc", embedding=True) == [0, abc]


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="common.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**{"tokenizer.ggml.pre": "martian"}))
    assert "martian" in caplog.text
    assert tok.decode(tok.encode("abc ab", add_special_tokens=False)) == "abc ab"


# ---- SentencePiece ("llama") GGUF vocabularies ------------------------------------------------------

_SPM_PIECES = ["▁", "a", "b", "c", "d", "▁a", "ab", "bc", "▁ab", "abc", "▁abc", "cd", "▁b", "dd", "bcd"]


def _spm_meta() -> dict:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *_SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES)
    rng = random.Random(7)
    scores = [0.0] * (3 + 256) + [-rng.uniform(0, 10) for _ in _SPM_PIECES]  # distinct, shuffled scores
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def _spm_reference(text: str, meta: dict) -> list[int]:
    """llama.cpp's SPM tokenizer: space prefix, then repeatedly merge the adjacent pair whose joined
    piece has the best score (leftmost on ties); characters with no piece become byte tokens."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    piece_id = {t: i for i, t in enumerate(tokens) if meta["tokenizer.ggml.token_type"][i] == 1}
    symbols = list(("▁" + text).replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in piece_id and (best is None or scores[piece_id[joined]] > scores[piece_id[best[1]]]):
                best = (i, joined)
        if best is None:
            break
        i, joined = best
        symbols[i : i + 2] = [joined]
    ids = []
    for sym in symbols:
        if sym in piece_id:
            ids.append(piece_id[sym])
        else:
            ids.extend(tokens.index(f"<0x{b:02X}>") for b in sym.encode("utf-8"))
    return ids


def test_sentencepiece_vocab_matches_reference_algorithm():
    meta = _spm_meta()
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos is True  # SentencePiece GGUFs default to BOS, as in llama.cpp
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abcd  é") for _ in range(rng.randint(1, 12)))
        assert tok.encode(text, add_special_tokens=False) == _spm_reference(text, meta), text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_sentencepiece_special_tokens_and_byte_fallback():
    tok = Tokenizer.from_gguf_metadata(_spm_meta())
    ids = tok.encode("ab\n</s>ab")
    # BOS; "▁ab"; "\n" by byte fallback; </s>; and, as llama.cpp does, a space prefix after a special token.
    assert ids == [1, tok.token_to_id("▁ab"), tok.token_to_id("<0x0A>"), 2, tok.token_to_id("▁ab")]
    assert tok.decode(ids, skip_special_tokens=True) == "ab\n ab"


# ---- crafted GGUF files -----------------------------------------------------------------------------


def _write_gguf(path: Path, model: str) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["<unk>", "a", "b"])
    writer.add_token_types([2, 1, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unknown_tokenizer_model_in_gguf(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "t5")
    with pytest.raises(UnsupportedModelError, match="t5"):
        Tokenizer.from_path(path)


def test_gguf_file_read_end_to_end(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama")
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == 3
    assert tok.decode([1, 2]) == "ab"


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_path(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf(junk)
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ModelFormatError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelFormatError, match="merge"):
        Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**{"tokenizer.ggml.merges": ["ab"]}))


# ---- Hugging Face directory against transformers -----------------------------------------------------

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. 12345 67890",
    "Tokenizers split text into pieces; héllo wörld, ça va? 模型 GPU 😀",
    "def add(a, b):\n    return a + b\n\n\tindent   spaces   here",
] * 20


def build_hf_dir(path: Path, *, add_bos: bool | None = None) -> Path:
    """Train a tiny byte-level BPE and save it as a model directory transformers can load."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TRAIN_TEXT, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": CHATML,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_hf_dir(tmp_path_factory.mktemp("hf") / "tiny")


def test_hf_dir_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_path(hf_dir)
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    texts = [*_TRAIN_TEXT[:3], "unseen words: zebra 99 ÆØÅ 🤖 <|im_start|>user\nhi<|im_end|>", "  \n\n x"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(theirs)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_hf_dir_special_ids_and_generation_config(hf_dir):
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.stop_token_ids == frozenset({0, 2})  # generation_config's list, plus eos
    assert tok.add_bos is False  # no flag and no post-processor adding BOS
    assert tok.chat_template == CHATML


def test_hf_dir_add_bos_flag(tmp_path):
    tok = Tokenizer.from_hf_dir(build_hf_dir(tmp_path / "bos", add_bos=True))
    assert tok.encode("hi")[0] == tok.bos_token_id == 1
    assert tok.encode("<|im_start|>hi").count(1) == 1


def test_hf_dir_end_token_is_the_post_processors(tmp_path):
    """Qwen3-Embedding's tokenizer.json ends every text with <|endoftext|>, while its config's
    eos_token is <|im_end|>: the token transformers appends is the one an embedding input ends
    with. The config's add_eos_token is not read (transformers' fast tokenizers do not)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    assert Tokenizer.from_hf_dir(build_hf_dir(tmp_path / "plain")).end_token_id is None
    flagged = build_hf_dir(tmp_path / "flag")
    config = json.loads((flagged / "tokenizer_config.json").read_text())
    (flagged / "tokenizer_config.json").write_text(json.dumps(config | {"add_eos_token": True}))
    tok = Tokenizer.from_hf_dir(flagged)
    assert tok.end_token_id is None
    assert tok.encode("hi", embedding=True) == AutoTokenizer.from_pretrained(str(flagged))("hi")["input_ids"]

    def processed(name: str, single: str, token: str, token_id: int) -> Path:
        path = build_hf_dir(tmp_path / name)
        inner = HFTokenizer.from_file(str(path / "tokenizer.json"))
        inner.post_processor = TemplateProcessing(single=single, special_tokens=[(token, token_id)])
        inner.save(str(path / "tokenizer.json"))
        return path

    qwen3_embedding = processed("post", "$A <|endoftext|>", "<|endoftext|>", 0)
    tok = Tokenizer.from_hf_dir(qwen3_embedding)
    assert tok.eos_token_id == 2 and tok.end_token_id == 0  # not the config's EOS
    theirs = AutoTokenizer.from_pretrained(str(qwen3_embedding))
    for text in ("hi", "two words<|endoftext|>"):
        assert tok.encode(text, embedding=True) == theirs(text)["input_ids"]
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # a prompt: none
    # a post-processor that starts every text with a special token adds no end token
    assert Tokenizer.from_hf_dir(processed("bos", "<|im_end|> $A", "<|im_end|>", 2)).end_token_id is None


def test_hf_dir_chat_template_file_wins(tmp_path):
    path = build_hf_dir(tmp_path / "jinja")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "x"
