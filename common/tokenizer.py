"""Text <-> token ids for a model, built from a GGUF file or a Hugging Face model directory.

Both sources end in one `tokenizers.Tokenizer`; this class adds what serving needs around it:
the BOS rule, the end-of-generation id set and the chat template. It never imports torch, so the
coordinator can use it.

GGUF vocabularies are data, not code: `tokenizer.ggml.model` picks the model family and
`tokenizer.ggml.pre` picks the pre-tokenizer regexes from `_PRE_TOKENIZERS`, mirroring llama.cpp's
table (llama-vocab.cpp), so the ids equal llama.cpp's for the same file.
"""

from __future__ import annotations

import copy
import functools

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from common.chat_template import render_chat
from common.errors import InvalidOptionError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from common.gguf_metadata import is_gguf_file

if TYPE_CHECKING:
    import gguf

log = logging.getLogger(__name__)

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED = 2, 3, 4

_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: no encoder takes it alone
# Texts of control tokens that end a turn, which llama.cpp adds to its end-of-generation set.
_EOG_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>", "<end_of_turn>", "<|end|>", "<|eom_id|>"}
)

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]  # applied in order, each splitting the pieces the previous one made
    ignore_merges: bool = False  # a whole pre-token found in the vocab is one token (Llama-3 rule)


_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "gpt-2": _PreTokenizer((_GPT2_RE,)),
    "default": _PreTokenizer((_GPT2_RE,)),
    # SmolLM: every digit is its own pre-token, then the GPT-2 regex.
    "smollm": _PreTokenizer((r"\p{N}", _GPT2_RE)),
    "llama-bpe": _PreTokenizer((_LLAMA3_RE,), ignore_merges=True),
    "llama3": _PreTokenizer((_LLAMA3_RE,), ignore_merges=True),
    "qwen2": _PreTokenizer((_QWEN2_RE,)),
}


class Tokenizer:
    """A model's tokenizer. Build with `from_path`, `from_gguf`, `from_gguf_reader` or `from_hf_dir`."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_stop_ids: frozenset[int] = frozenset(),
        add_bos: bool,
        chat_template: str | None,
        end_token_id: int | None = None,
    ) -> None:
        self._tok = tok
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        # The token an embedding input ends with (encode(..., embedding=True)), None: none.
        # Embedding models pooled at the last token (Qwen3-Embedding) read their vector at an
        # end-of-text token their tokenizer appends: a GGUF says so with add_eos_token (EOS;
        # the converter makes that token the file's EOS), a Hugging Face tokenizer.json with
        # a post-processor that ends every text with a special token (<|endoftext|>, not the
        # config's eos_token <|im_end|>). Chat and completion prompts never get it: the
        # transformers chat path adds no special tokens at all.
        self.end_token_id = end_token_id
        self.chat_template = chat_template
        special_texts = {
            added.content
            for added in tok.get_added_tokens_decoder().values()
            if added.special and added.content in _EOG_TEXTS
        }
        eog = {tok.token_to_id(text) for text in special_texts}
        if eos_token_id is not None:
            eog.add(eos_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(eog | set(extra_stop_ids))

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A GGUF file (by its magic, whatever its name) or a Hugging Face model directory."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        if not path.exists():
            raise ModelNotFoundError(f"no tokenizer at {path}")
        if path.suffix.lower() == ".gguf" or is_gguf_file(path):
            return cls.from_gguf(path)
        raise ModelFormatError(f"{path} is neither a GGUF file nor a model directory")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"no GGUF file at {path}")
        # Our own header parser reads the 49k-token vocabulary in ~0.1 s; gguf.GGUFReader
        # takes seconds. It raises ModelFormatError itself for non-GGUF or truncated files.
        from common.gguf_metadata import read_gguf_metadata

        meta = read_gguf_metadata(path)
        return cls.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")},
                                      source=str(path))

    @classmethod
    def from_gguf_reader(cls, reader: gguf.GGUFReader, *, source: str = "GGUF") -> Tokenizer:
        """Reuse a reader the weight loader already opened: parsing the metadata costs seconds."""
        meta = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
        return cls.from_gguf_metadata(meta, source=source)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], *, source: str = "GGUF") -> Tokenizer:
        """Build from the `tokenizer.*` GGUF keys, already decoded to Python values."""
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise ModelFormatError(f"{source} has no tokenizer (tokenizer.ggml.model/tokens missing)")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFormatError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        if model == "gpt2":
            tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta, source)
            default_add_bos = False
        elif model == "llama":
            tok = _sentencepiece_bpe(tokens, types, meta, source)
            default_add_bos = True
        else:
            raise UnsupportedModelError(f"{source}: tokenizer model {model!r} is not supported (gpt2, llama are)")
        _add_special_tokens(tok, tokens, types)

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        end_of_turn = (token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id"))
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token"))
        return cls(
            tok,
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos_id,
            extra_stop_ids=frozenset(i for i in end_of_turn if i is not None),
            add_bos=default_add_bos if add_bos is None else bool(add_bos),
            end_token_id=eos_id if add_eos else None,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ generation_config.json, chat_template.jinja)."""
        path = Path(path)
        if not path.is_dir():
            raise ModelNotFoundError(f"no model directory at {path}")
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFormatError(f"{path} has no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises bare Exception for any parse failure
            raise ModelFormatError(f"{tok_file} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")

        def special_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
        gen_eos = gen_config.get("eos_token_id")
        gen_eos_ids = [i for i in (gen_eos if isinstance(gen_eos, list) else [gen_eos]) if isinstance(i, int)]
        if eos_id is None and gen_eos_ids:
            eos_id = int(gen_eos_ids[0])
        if bos_id is None and isinstance(gen_config.get("bos_token_id"), int):
            bos_id = gen_config["bos_token_id"]

        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: follow the post-processor, which is what transformers does.
            add_bos = bos_id is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        # The post-processor's token after the text, if it adds one (what transformers' encode
        # appends; the config's add_eos_token is not read: transformers' fast tokenizers
        # follow the post-processor).
        plain = tok.encode("a", add_special_tokens=False).ids
        special = tok.encode("a", add_special_tokens=True)
        end_id = (special.ids[-1] if len(special.ids) > len(plain) and special.special_tokens_mask[-1]
                  else None)
        return cls(
            tok,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            extra_stop_ids=frozenset(gen_eos_ids),
            add_bos=bool(add_bos),
            end_token_id=end_id,
            chat_template=_hf_chat_template(path, config),
        )

    # ---- use ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers.Tokenizer` inside, for libraries that read a vocabulary and its
        encoding themselves (llguidance, engine/grammar.py). Not to be modified."""
        return self._tok

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the longest
        vocabulary entry in UTF-8 (byte-level BPE maps each byte to one char of 1-2 UTF-8
        bytes, SentencePiece's '▁' of 3 bytes stands for one space, so it is never too small).
        A text of more bytes than max_token_bytes * n surely has more than n tokens."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)

    def encode(self, text: str, add_special_tokens: bool = True, embedding: bool = False) -> list[int]:
        """Special-token text (`<|im_start|>`) becomes its token; BOS is added at most once.
        embedding: an embedding input, which also ends with end_token_id where the vocabulary
        has one (with add_special_tokens only)."""
        if not isinstance(text, str):
            raise InvalidOptionError(f"text to encode must be a str, got {type(text).__name__}")
        surrogate = _SURROGATE.search(text)
        if surrogate is not None:  # a str that is not valid Unicode, e.g. from JSON's "\ud800"
            raise InvalidOptionError(f"text holds a lone surrogate (U+{ord(surrogate.group()):04X}), "
                                     "which is not valid Unicode")
        # The inner tokenizer's own post-processor is bypassed so the BOS rule is ours alone.
        # encode_batch, not encode: it releases the GIL (measured: encode of a 3.7 MB text held
        # it for 3.8 s, stalling every thread of the coordinator), and gives the same ids.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if ids[:1] != [self.bos_token_id]:
                ids.insert(0, self.bos_token_id)
        if add_special_tokens and embedding and self.end_token_id is not None:
            ids.append(self.end_token_id)  # always, as transformers and llama.cpp append it
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise InvalidOptionError(f"token id {bad} is outside the vocabulary (size {self._vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        token = self._tok.id_to_token(token_id) if 0 <= token_id < self._vocab_size else None
        if token is None:
            raise InvalidOptionError(f"token id {token_id} is outside the vocabulary (size {self._vocab_size})")
        return token

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """This tokenizer rendering `chat_template` instead (the vocabulary is shared, not copied)."""
        other = copy.copy(self)
        other.chat_template = chat_template
        return other

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **extra: Any
    ) -> str:
        def text(token_id: int | None) -> str | None:
            return None if token_id is None else self._tok.id_to_token(token_id)

        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=text(self.bos_token_id),
            eos_token=text(self.eos_token_id),
            tools=tools,
            **extra,
        )


# ---- GGUF builders -------------------------------------------------------------------------------


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a duplicated text keeps its first id, as llama.cpp's lookup does
    return vocab


def _byte_level_bpe(tokens: list[str], merges: list[str], meta: Mapping[str, Any], source: str) -> HFTokenizer:
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        log.warning("%s: unknown pre-tokenizer %r, using GPT-2's; ids may differ from llama.cpp", source, pre_name)
        pre = _PRE_TOKENIZERS["gpt-2"]
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"{source}: malformed merge {merge!r}")
        pairs.append((left, right))
    tok = HFTokenizer(models.BPE(_vocab(tokens), pairs, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre.regexes]
    # use_regex=False: the splits above replace ByteLevel's built-in GPT-2 regex.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[int], meta: Mapping[str, Any], source: str) -> HFTokenizer:
    """SentencePiece vocab (▁ for space, <0xNN> byte tokens) as a BPE with merges ranked by score.

    SentencePiece merges the adjacent pair whose joined piece scores highest; a BPE whose merge
    ranks follow the joined piece's score makes the same choices.
    """
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = _vocab(tokens)
    ranked = []
    for token, token_id in vocab.items():
        if types[token_id] != 1:  # only NORMAL pieces are reachable by merging
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    unk = next((tokens[i] for i, t in enumerate(types) if t == _TYPE_UNKNOWN), None)
    model = models.BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(model)
    # A normalizer runs on each stretch of text between special tokens, so the space prefix is
    # added at the start and after every special token, as llama.cpp's SPM tokenizer does.
    steps = [normalizers.Replace(" ", "▁")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # CONTROL tokens are special (skipped when decoding with skip_special_tokens); USER_DEFINED
    # ones are printed like text. Both are matched whole before any pre-tokenizing.
    control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TYPE_CONTROL]
    user = [
        AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TYPE_USER_DEFINED
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


# ---- HF directory helpers ------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} should hold a JSON object")
    return data


def _hf_chat_template(path: Path, config: dict) -> str | None:
    jinja_file = path / "chat_template.jinja"  # newer transformers save the template beside the config
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
