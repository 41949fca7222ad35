"""kernels/copy_crc32c.py: the native CRC32C over gather lists (and its fused copy) equals the
crc32c package on every alignment and length around the kernel's stream and chunk sizes; the
copy lands; the read-back catches a flipped byte; the fallback (no native library) agrees."""

from __future__ import annotations

import random

import crc32c
import pytest
import torch

from kernels import copy_crc32c as cc
from kernels import native

# Lengths around the kernel's boundaries: 8-byte words, 3 x 256 and 3 x 8192 byte stream
# groups (the 24 KiB read-back chunk), a 16 KiB boundary.
LENGTHS = [0, 1, 7, 8, 9, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 13, 16384, 16385,
           100_003]


@pytest.fixture(params=["native", "fallback"])
def impl(request, monkeypatch):
    if request.param == "native":
        if not native.available():
            pytest.skip("no native kernels here")
    else:
        monkeypatch.setattr(cc.native, "available", lambda: False)
    return request.param


def _source(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_crc_of_ranges_matches_crc32c(impl):
    src = _source(1 << 18, 0)
    data = bytes(src.numpy())
    rng = random.Random(1)
    for length in LENGTHS:
        for _ in range(3):
            ranges, want = [], 7
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(0, len(data) - length + 1)  # any alignment
                ranges.append((src.data_ptr() + at, length))
                want = crc32c.crc32c(data[at:at + length], want)
            assert cc.crc32c_ranges(ranges, 7) == want, (length, ranges)


def test_copy_lands_and_returns_the_source_crc(impl):
    src = _source(1 << 18, 2)
    data = bytes(src.numpy())
    rng = random.Random(3)
    for length in LENGTHS:
        dst = torch.zeros(4 * length + 64, dtype=torch.uint8)
        copies, want, pieces, at_dst = [], 0, [], 5  # an odd destination offset
        for _ in range(3):
            at = rng.randrange(0, len(data) - length + 1)
            copies.append((dst.data_ptr() + at_dst, src.data_ptr() + at, length))
            want = crc32c.crc32c(data[at:at + length], want)
            pieces.append((at_dst, data[at:at + length]))
            at_dst += length + 3
        assert cc.copy_crc32c(copies) == want
        got = bytes(dst.numpy())
        for offset, piece in pieces:
            assert got[offset:offset + len(piece)] == piece


def test_streamed_copy_lands_and_returns_the_source_crc(impl):
    """stream=True (non-temporal stores): the same bytes and CRC as a cached copy, on every
    length around the stream groups and on odd destination offsets (movnti unaligned)."""
    src = _source(1 << 18, 6)
    data = bytes(src.numpy())
    rng = random.Random(7)
    for length in LENGTHS:
        for dst_offset in (0, 3, 64):
            dst = torch.zeros(length + 128, dtype=torch.uint8)
            at = rng.randrange(0, len(data) - length + 1)
            copies = [(dst.data_ptr() + dst_offset, src.data_ptr() + at, length)]
            got = cc.copy_crc32c(copies, value=11, verify=False, stream=True)
            assert got == crc32c.crc32c(data[at:at + length], 11), (length, dst_offset)
            out = bytes(dst.numpy())
            assert out[dst_offset:dst_offset + length] == data[at:at + length]
            assert out[:dst_offset] == bytes(dst_offset)  # nothing written outside the range
            assert out[dst_offset + length:] == bytes(128 - dst_offset)


def test_stream_excludes_the_read_back():
    src = _source(64, 8)
    dst = torch.zeros_like(src)
    with pytest.raises(ValueError, match="stream"):
        cc.copy_crc32c([(dst.data_ptr(), src.data_ptr(), 64)], stream=True)


def test_native_refuses_bad_flags():
    """The native entry point refuses read-back with streaming (flags 3) and unknown bits
    itself, writing nothing, whatever its caller checked."""
    import ctypes

    if not native.available():
        pytest.skip("no native kernels here")
    src = _source(64, 9)
    dst = torch.zeros_like(src)
    arr = lambda v: (ctypes.c_int64 * 1)(v)  # noqa: E731
    out = ctypes.c_uint32()
    for flags in (3, 4, -1):
        code = native.library().tandem_copy_crc32c(1, arr(src.data_ptr()), arr(dst.data_ptr()), arr(64), 0,
                                                  flags, -1, ctypes.byref(out))
        assert code == 1, flags
    assert not dst.any()


@pytest.mark.parametrize("where", [0, 5000, 3 * 8192, 16384, 70_000 - 1])
def test_read_back_catches_a_flipped_byte(impl, where):
    src = _source(70_000, 4)
    dst = torch.zeros_like(src)
    copies = [(dst.data_ptr(), src.data_ptr(), 30_000), (dst.data_ptr() + 30_000, src.data_ptr() + 30_000, 40_000)]
    with pytest.raises(cc.CopyMismatch):
        cc.copy_crc32c(copies, corrupt_at=where)
    # Without verify the same write goes unnoticed here: the check is what catches it.
    dst.zero_()
    assert cc.copy_crc32c(copies, verify=False, corrupt_at=where) == crc32c.crc32c(bytes(src.numpy()))
    assert (dst != src).sum().item() == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="CRC32C value"):
        cc.crc32c_ranges([], -1)
    with pytest.raises(ValueError, match=">= 0"):
        cc.copy_crc32c([(0, 0, -5)])


def test_stream_copies_cut_at_both_sides_and_land_the_stream(impl):
    """One byte stream, held as source ranges cut one way (received frames) and written to
    destination ranges cut another (cache blocks): every byte lands in order and the CRC is the
    stream's, whatever the cuts."""
    rng = random.Random(5)
    for _ in range(20):
        total = rng.randint(1, 50_000)
        src = _source(total, rng.randint(0, 99))
        dst = torch.zeros(total + 64, dtype=torch.uint8)

        def cuts(n):  # random pieces summing to n, empty ones included
            at, out = 0, []
            while at < n:
                size = min(n - at, rng.choice([0, 1, 7, 64, 1000, 20_000]))
                out.append(size)
                at += size
            return out

        src_ranges, at = [], 0
        for size in cuts(total):
            src_ranges.append((src.data_ptr() + at, size))
            at += size
        # Destination pieces in a shuffled order of the buffer, so a wrong cut shows.
        pieces = cuts(total)
        offsets = list(range(len(pieces)))
        rng.shuffle(offsets)
        slots, at = {}, 0
        for i in offsets:
            slots[i] = at
            at += pieces[i]
        dst_ranges = [(dst.data_ptr() + slots[i], pieces[i]) for i in range(len(pieces))]
        crc = cc.copy_crc32c(cc.stream_copies(dst_ranges, src_ranges), verify=False)
        assert crc == crc32c.crc32c(bytes(src.numpy()))
        stream = 0
        for i, size in enumerate(pieces):
            assert torch.equal(dst[slots[i]:slots[i] + size], src[stream:stream + size])
            stream += size


def test_stream_copies_refuse_unequal_totals():
    with pytest.raises(ValueError, match="fewer bytes"):
        cc.stream_copies([(1000, 10)], [(0, 4), (100, 5)])
    with pytest.raises(ValueError, match="more bytes"):
        cc.stream_copies([(1000, 8)], [(0, 4), (100, 5)])
    assert cc.stream_copies([(1000, 9)], [(0, 4), (100, 0), (200, 5)]) == [(1000, 0, 4), (1004, 200, 5)]
