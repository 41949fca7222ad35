"""Blobs uploaded by digest (Ollama's /api/blobs/sha256:<hex>), kept under the model store.

    root/sha256-<hex>                       a verified blob: its bytes hash to <hex>
    root/.sha256-<hex>.<uuid>.partial       an upload in progress (removed if it fails)

An upload streams to its partial file, hashing as it goes; only a body whose sha256 is the
digest it was sent under, and no larger than the store's limit, is renamed to its final name
(atomically, so a reader never sees half a blob and two uploads of one digest cannot mix).
Every other ending (a wrong digest, the limit passed, the client gone, a full disk) removes the
partial file. Writes are blocking calls: the HTTP route runs them on a thread. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path

from common.errors import InvalidOptionError

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


class BlobDigestError(InvalidOptionError):
    """A malformed digest, or a body that does not hash to its digest (HTTP 400)."""


class BlobTooLargeError(InvalidOptionError):
    """A body past the store's size limit (HTTP 413)."""


class BlobSpaceError(InvalidOptionError):
    """No room left on the store's disk for a blob (HTTP 507)."""


def parse_digest(digest: str) -> str:
    """The hex of `sha256:<64 hex>` (or Ollama's file-name spelling `sha256-<hex>`)."""
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        shown = str(digest)[:80]
        raise BlobDigestError(f"invalid digest {shown!r}: expected sha256:<64 lowercase hex digits>")
    return m.group(1)


class BlobStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, digest: str) -> Path:
        return self.root / f"sha256-{parse_digest(digest)}"

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def receive(self, digest: str, announced: int | None = None) -> BlobUpload:
        """A new upload of `digest`; `announced`: the body's Content-Length, refused at once when
        it is past the limit or the free space."""
        target = self.path(digest)
        if announced is not None:
            self._check_size(announced)
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
            if announced > free:
                raise BlobSpaceError(f"a blob of {announced} bytes does not fit: {free} bytes "
                                     "are free in the model store")
        self.root.mkdir(parents=True, exist_ok=True)
        return BlobUpload(self, target, parse_digest(digest))

    def _check_size(self, size: int) -> None:
        if size > self.max_bytes:
            raise BlobTooLargeError(f"blob too large: the limit is {self.max_bytes} bytes "
                                    "(python -m coordinator --max-blob-bytes)")


class BlobUpload:
    """One upload: write() its bytes in order, then commit(); abort() on any other ending.
    Invariant: once commit() or abort() returns, no partial file of it remains."""

    def __init__(self, store: BlobStore, target: Path, hex_digest: str) -> None:
        self._store = store
        self.target = target
        self._expected = hex_digest
        self._partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
        self._file = open(self._partial, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        try:
            self._store._check_size(self.size + len(data))
            self._file.write(data)
        except OSError as exc:
            self.abort()
            raise BlobSpaceError(f"the blob could not be written: {exc.strerror or exc}") from None
        except BaseException:
            self.abort()
            raise
        self._hash.update(data)
        self.size += len(data)

    def commit(self) -> Path:
        """The verified blob's path; BlobDigestError (and nothing kept) if the bytes hash to
        another digest."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            actual = self._hash.hexdigest()
            if actual != self._expected:
                raise BlobDigestError(f"digest mismatch: the body's sha256 is {actual}, not "
                                      f"{self._expected}")
            os.replace(self._partial, self.target)
            return self.target
        except OSError as exc:
            raise BlobSpaceError(f"the blob could not be written: {exc.strerror or exc}") from None
        finally:
            self.abort()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._partial.unlink(missing_ok=True)
