"""Tenants: who a client-API caller is, for the prefix cache's isolation.

The prefix cache reports how much of a prompt was already cached (`cached_tokens`, and the
time to first token shows it too), so a shared cache tells one user what another sent: guessing
a secret block by block works. tandem therefore shares cached blocks only within a tenant:

    tenant   the name of the API key the caller presented (an API keys file names each key,
             `name key` per line; the single TANDEM_API_KEY is the tenant "default"); ""
             when the server has no keys (a single-user server: one shared cache)
    salt     (common/block_hash.py) b"" for tenant "" without a request salt, else a digest of
             the tenant and the request's own `cache_salt` (vLLM's field: a client may split its
             own traffic further, never join another tenant's)

Workers hash every block of a request from its salt's root, so two tenants' equal prompts
never share a block and a request's `cached_tokens` counts only its own tenant's blocks.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from pathlib import Path

from common.errors import InvalidOptionError

DEFAULT_TENANT = "default"  # the tenant of the single TANDEM_API_KEY
MAX_CACHE_SALT_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def cache_salt(tenant: str, request_salt: str | None = None) -> bytes:
    """The prefix-cache salt of a request by `tenant` with its own `cache_salt` field."""
    if request_salt is not None:
        if not isinstance(request_salt, str) or not 0 < len(request_salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidOptionError(f"cache_salt must be a non-empty string of at most "
                                     f"{MAX_CACHE_SALT_CHARS} characters")
    if not tenant and not request_salt:
        return b""
    return hashlib.sha256(f"{tenant}\0{request_salt or ''}".encode()).digest()[:16]


class ApiKeys:
    """The keys the client APIs accept, each naming its tenant. Compared by digest, in
    constant time per key."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        """keys: tenant name -> key."""
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [(name, hashlib.sha256(key.encode()).digest()) for name, key in keys.items()]
        self.tenants = tuple(keys)

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant whose key `authorization` (a header's or metadata's value) presents as
        `Bearer KEY`, or None. The scheme is case-insensitive (RFC 7235)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        # latin-1: the bytes the client sent (Starlette decodes header values as latin-1).
        presented = hashlib.sha256(token.encode("latin-1", "replace")).digest()
        found = None
        for name, digest in self._digests:  # every key compared, whichever matches
            if hmac.compare_digest(presented, digest):
                found = name
        return found

    def matches(self, authorization: str | None) -> bool:
        return self.tenant(authorization) is not None


def read_keys_file(path: str | Path) -> dict[str, str]:
    """An API keys file: one `NAME KEY` per line (blank lines and `#` comments skipped).
    ValueError naming the line for a malformed one or a repeated name or key."""
    keys: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not _NAME.fullmatch(parts[0]):
            raise ValueError(f"{path}:{number}: expected `NAME KEY` (a name of letters, digits "
                             "and _.@-, then the key)")
        name, key = parts
        if name in keys or key in keys.values():
            raise ValueError(f"{path}:{number}: the name or key of tenant {name!r} repeats")
        keys[name] = key
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys
