"""GGUF header reading, torch-free and numpy-free, so the coordinator can read a model's config
and tokenizer without loading weights.

A GGUF file is laid out as

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value type u32, value)
    n_tensors x (name: string, n_dims u32, ne[n_dims] u64, ggml type u32, offset u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor's offset is relative to here

Strings are (length u64, utf-8 bytes). ne[0] is the innermost (fastest-varying) dimension, the
reverse of torch's shape order. We parse the header ourselves instead of with gguf.GGUFReader:
the reader builds a numpy view per array element, which costs ~2 s for a 49k-token vocabulary,
whereas struct over an mmap reads the same header in tens of milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.model_config import ModelConfig, RopeScaling
from common.pooling import Pooling
from common.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# llama.cpp's enum llama_pooling_type, as `<arch>.pooling_type` stores it: 0 none, 1 mean, 2 cls,
# 3 last, 4 rank. Only last changes the default here; cls and rank belong to encoder and
# reranker heads, which these decoders do not have, so they are read as mean.
LLAMA_POOLING_LAST = 3

# GGUF value type id -> struct format of one scalar. 8 (string) and 9 (array) are handled apart.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# general.architecture -> (ModelConfig.architecture, attention_bias, qk_norm). Mistral GGUFs
# say "llama".
GGUF_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("llama", False, False),
    "qwen2": ("qwen2", True, False),
    "qwen3": ("qwen3", False, True),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value; kept as int so this module needs no gguf
    shape: tuple[int, ...]  # torch order (outermost first), i.e. reversed ne
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_offset: int  # absolute offset where tensor data starts
    file_size: int


class _Cursor:
    """Little-endian reads from a buffer; running off the end means the file is truncated."""

    def __init__(self, buf: Any, offset: int = 0) -> None:
        self.buf = buf
        self.offset = offset

    def read(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        length = self.read("Q")
        end = self.offset + length
        if end > len(self.buf):
            raise struct.error(f"string of {length} bytes runs past the end of the file")
        raw = bytes(self.buf[self.offset:end])
        self.offset = end
        return raw.decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.read("I"), self.read("Q")
            if item_type in _SCALAR_FORMATS:
                # One unpack for the whole array: a vocabulary's token types are ~50k ints.
                fmt = f"{count}{_SCALAR_FORMATS[item_type]}"
                items = struct.unpack_from("<" + fmt, self.buf, self.offset)
                self.offset += struct.calcsize("<" + fmt)
                return list(items)
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.read(_SCALAR_FORMATS[vtype])


def is_gguf_file(path: str | Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does, whatever its name: Ollama's
    blobs (`blobs/sha256-<hex>`) have no suffix."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the key/values and tensor table of a GGUF file. Raises ModelNotFoundError for a
    missing file and ModelFormatError for anything that is not a complete GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no model file at {path}")
    with open(path, "rb") as f:
        file_size = path.stat().st_size
        if file_size < 24:
            raise ModelFormatError(f"{path}: not a GGUF file (only {file_size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise ModelFormatError(
                    f"{path}: not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')")
            try:
                return _parse(path, buf, file_size)
            except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as e:
                raise ModelFormatError(f"{path}: corrupt or truncated GGUF header: {e}") from e


def _parse(path: Path, buf: mmap.mmap, file_size: int) -> GGUFHeader:
    cur = _Cursor(buf, 4)
    version = cur.read("I")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
        raise UnsupportedModelError(
            f"{path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
    n_tensors, n_kv = cur.read("Q"), cur.read("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.read("I"))

    raw_tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.read("I")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, cur.offset)
        cur.offset += 8 * n_dims
        ggml_type, offset = cur.read("I"), cur.read("Q")
        raw_tensors.append((name, ggml_type, tuple(reversed(ne)), offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFormatError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    data_offset = -(-cur.offset // alignment) * alignment
    tensors = [GGUFTensorInfo(name, t, shape, data_offset + off) for name, t, shape, off in raw_tensors]
    return GGUFHeader(path, version, metadata, tensors, data_offset, file_size)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All GGUF key/values as Python values (str, int, float, bool, lists of those)."""
    return read_gguf_header(path).metadata


def gguf_config(metadata: dict[str, Any], name: str | None = None) -> ModelConfig:
    """ModelConfig from GGUF key/values (llama.cpp's `{arch}.*` keys)."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})")
    family, attention_bias, qk_norm = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    def count(key: str, default: Any = None) -> int:
        # A count of another type (a string, a float, an array) is a corrupt file: said here,
        # before `hidden // num_heads` divides by it or a loop runs over it.
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFormatError(f"GGUF metadata {arch}.{key} must be a positive integer, "
                                   f"got {_short(value)}")
        return value

    hidden = count("embedding_length")
    num_heads = count("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    # Some files store a per-layer list of kv head counts; we need them all equal.
    if isinstance(num_kv_heads, list):
        if len(set(map(repr, num_kv_heads))) != 1:
            raise UnsupportedModelError(f"per-layer kv head counts {_short(num_kv_heads)} "
                                        "are not supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = get("attention.key_length", hidden // num_heads)
    rope_dim = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings (rope.dimension_count {rope_dim} != head_dim {head_dim}) "
            "are not supported")
    value_length = metadata.get(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise UnsupportedModelError(f"value head size {value_length} != key head size {head_dim}")

    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFormatError(f"GGUF metadata has neither {arch}.vocab_size nor "
                                   "tokenizer.ggml.tokens")
        vocab = len(tokens)

    try:
        return ModelConfig(
            architecture=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(metadata, arch),
            max_position=get("context_length", 2048),
            # The loader sets this from the tensors (output.weight absent means tied).
            tie_word_embeddings=False,
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            name=name or metadata.get("general.name") or "model",
            pooling=Pooling.LAST if metadata.get(f"{arch}.pooling_type") == LLAMA_POOLING_LAST
            else Pooling.MEAN,
        )
    except (ValueError, TypeError) as e:  # TypeError: float() of an array-valued key
        raise ModelFormatError(f"GGUF metadata describes an invalid model: {e}") from e


def _short(value: Any, limit: int = 80) -> str:
    """A metadata value in a message: a corrupt array may hold millions of items."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _rope_scaling(metadata: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor", 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(factor))
    raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear)")


def gguf_header_config(header: GGUFHeader, name: str | None = None) -> ModelConfig:
    """ModelConfig from a parsed header: the key/values plus what only the tensor table tells
    (tied embeddings, llama3-style rope_freqs). Errors name the file."""
    names = {t.name for t in header.tensors}
    try:
        if "rope_freqs.weight" in names:
            # llama.cpp folds Llama-3.1 rope scaling into a per-dimension factor tensor and drops
            # the parameters (factor, low/high_freq_factor) that our RopeScaling needs; guessing
            # them back from the tensor would silently change long-context behaviour.
            raise UnsupportedModelError("llama3-style rope scaling stored as a rope_freqs.weight "
                                        "tensor is not supported; use the Hugging Face directory")
        config = gguf_config(header.metadata, name)
    except (ModelFormatError, UnsupportedModelError) as e:
        raise type(e)(f"{header.path}: {e}") from e
    return replace(config, tie_word_embeddings="output.weight" not in names,
                   attention_bias=config.attention_bias or "blk.0.attn_q.bias" in names,
                   qk_norm=config.qk_norm or "blk.0.attn_q_norm.weight" in names)
