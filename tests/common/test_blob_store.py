"""Blobs by digest (common/blob_store.py): verified before they get their name, bounded, and
never left half written."""

from __future__ import annotations

import hashlib

import pytest

from common.blob_store import (
    BlobDigestError, BlobStore, BlobTooLargeError, parse_digest,
)

DATA = b"some model bytes" * 1000
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


def files(store: BlobStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir())


def test_digests_are_sha256_in_either_spelling():
    hex_ = DIGEST[7:]
    assert parse_digest(DIGEST) == parse_digest(f"sha256-{hex_}") == hex_
    for bad in ("sha256:" + hex_.upper(), "sha256:" + hex_[:-1], "md5:" + hex_, "", None,
                f"sha256:{hex_}/../x"):
        with pytest.raises(BlobDigestError, match="invalid digest"):
            parse_digest(bad)


def test_a_verified_upload_gets_its_name_and_a_wrong_one_leaves_nothing(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_bytes=len(DATA))
    wrong = store.receive(DIGEST)
    wrong.write(DATA[:-1] + b"?")
    with pytest.raises(BlobDigestError, match="digest mismatch"):
        wrong.commit()
    assert files(store) == [] and not store.has(DIGEST)
    upload = store.receive(DIGEST, announced=len(DATA))
    for i in range(0, len(DATA), 999):
        upload.write(DATA[i:i + 999])
    assert upload.commit() == store.path(DIGEST) and store.has(DIGEST)
    assert store.path(DIGEST).read_bytes() == DATA and files(store) == [f"sha256-{DIGEST[7:]}"]


def test_the_size_limit_holds_announced_or_counted(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_bytes=len(DATA) - 1)
    with pytest.raises(BlobTooLargeError, match=f"the limit is {len(DATA) - 1} bytes"):
        store.receive(DIGEST, announced=len(DATA))
    upload = store.receive(DIGEST)
    upload.write(DATA[:100])
    with pytest.raises(BlobTooLargeError):
        upload.write(DATA[100:])
    assert files(store) == []  # the partial file went with the refusal
    upload.abort()  # idempotent
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        BlobStore(tmp_path, max_bytes=0)
