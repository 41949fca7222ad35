"""Chained block hashes of token ids: the prefix cache's keys (engine/block_manager.py) and the
coordinator's prefix-aware routing key (coordinator/placement.py). Torch-free.

hash(block i) = blake2b(hash(block i-1) + the block's token ids as little-endian int64), so equal
hashes mean equal whole prefixes, not just equal blocks.

Tenants. The chain starts from a root: b"" for the shared cache, or a digest of a salt (the
coordinator derives one per API-key tenant and from a request's `cache_salt`). Prompts with
different salts never share a block, so the prefix cache, and the `cached_tokens` it reports,
cannot tell one tenant what another sent.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    # Fixed-width little-endian ints, so the digest depends only on the values.
    data = struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


ROOT_HASH = b""  # parent hash of a table's first block


def root_hash(salt: bytes = b"") -> bytes:
    """The parent hash of a table's first block for `salt` (b"": the shared cache)."""
    if not salt:
        return ROOT_HASH
    return hashlib.blake2b(b"tandem-cache-salt|" + salt, digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chain hashes of the full blocks of `token_ids`, as a BlockManager registers them:
    the coordinator matches them against what workers publish (prefix-aware routing)."""
    hashes: list[bytes] = []
    parent = root_hash(salt)
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
