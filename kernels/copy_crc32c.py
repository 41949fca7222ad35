"""CRC32C over a gather list of byte ranges, optionally fused with their copy: what moves KV
blocks with their checksum (kvtransfer/). The native kernel (csrc/copy_crc32c.cpp) loads each
word once, folds it into the CRC and stores it, so checksum and copy cost one pass over the
bytes instead of two or three; it runs without the GIL (a ctypes call).

    crc32c_ranges([(address, nbytes), ...], value=0) -> crc
    copy_crc32c([(dst_address, src_address, nbytes), ...], value=0, verify=True, stream=False)
        -> crc of the source
    stream_copies(dst_ranges, src_ranges) -> the copies that move one byte stream, cut one way
        at the source (received frames) and another at the destination (cache blocks)

Both continue `value` exactly as crc32c.crc32c(data, value) does, so either side of a transfer
may compute its CRC either way. With verify, each copied chunk is compared with its source
while both are in cache, and a copy that does not read back raises CopyMismatch. With stream
(and verify=False) the stores go past the cache (movnti): a copy out of memory then moves two
lines per line instead of three (a plain store first reads its destination), so it runs ~1.5x
a memcpy; the destination is left in memory, so whoever needs it checked checks the CRC there.

Addresses are raw pointers: the caller has checked every range against the tensors it belongs
to (nothing here can). Without the native library (no compiler) the same results come from the
crc32c package and ctypes.memmove, chunk by chunk.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import crc32c as _crc32c

from kernels import native

# ctypes.memmove-and-crc32c granule of the fallback: a chunk stays in L2 between the passes.
_FALLBACK_CHUNK = 384 << 10


class CopyMismatch(RuntimeError):
    """A copied range does not read back as its source."""


def crc32c_ranges(ranges: Sequence[tuple[int, int]], value: int = 0) -> int:
    """CRC32C of the concatenated byte ranges (address, nbytes), continuing from `value`."""
    _check_value(value)
    if not native.available():
        for address, nbytes in ranges:
            value = _crc32c.crc32c(_view(address, nbytes), value)
        return value
    srcs, sizes = _array([a for a, _ in ranges]), _array([n for _, n in ranges])
    out = ctypes.c_uint32()
    native.check(native.library().tandem_copy_crc32c(
        len(ranges), srcs, None, sizes, value, 0, -1, ctypes.byref(out)), "crc32c")
    return out.value


def copy_crc32c(copies: Sequence[tuple[int, int, int]], value: int = 0, verify: bool = True,
                corrupt_at: int = -1, stream: bool = False) -> int:
    """Copy each (dst_address, src_address, nbytes) and return the CRC32C of the source bytes in
    order, continuing from `value`. Ranges must not overlap their destinations. With verify, a
    destination that does not read back as its source raises CopyMismatch (after the copy).
    stream stores past the cache (see the module docstring); it excludes verify, whose read-back
    would then come from memory. Without the native library it is a plain copy.

    corrupt_at >= 0 is a test seam: that byte of the concatenated destination is flipped after
    its copy and before the comparison, so a test can show the check catches a bad write."""
    _check_value(value)
    if verify and stream:
        raise ValueError("stream stores past the cache: a read-back (verify) would read memory "
                         "again; check the CRC at the destination instead")
    if not native.available():
        return _copy_crc32c_fallback(copies, value, verify, corrupt_at)
    dsts = _array([d for d, _, _ in copies])
    srcs = _array([s for _, s, _ in copies])
    sizes = _array([n for _, _, n in copies])
    out = ctypes.c_uint32()
    flags = int(bool(verify)) | 2 * int(bool(stream))
    code = native.library().tandem_copy_crc32c(len(copies), srcs, dsts, sizes, value,
                                               flags, corrupt_at, ctypes.byref(out))
    if code == 2:
        raise CopyMismatch("a copied range does not read back as its source")
    native.check(code, "copy_crc32c")
    return out.value


def stream_copies(dst_ranges: Sequence[tuple[int, int]],
                  src_ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The (dst, src, nbytes) copies that move the concatenated src ranges (address, nbytes)
    into the concatenated dst ranges, in stream order, cut wherever either side is: for
    copy_crc32c, whose CRC then runs over the stream. Both sides must hold the same total."""
    copies: list[tuple[int, int, int]] = []
    si, s_at = 0, 0  # current source range and the bytes of it already used
    for dst, want in dst_ranges:
        while want:
            if si == len(src_ranges):
                raise ValueError("the source ranges hold fewer bytes than the destination ranges")
            src, size = src_ranges[si]
            step = min(want, size - s_at)
            if step:
                copies.append((dst, src + s_at, step))
            dst, want, s_at = dst + step, want - step, s_at + step
            if s_at == size:
                si, s_at = si + 1, 0
    if sum(size for _, size in src_ranges[si:]) > s_at:
        raise ValueError("the source ranges hold more bytes than the destination ranges")
    return copies


def _copy_crc32c_fallback(copies: Sequence[tuple[int, int, int]], value: int, verify: bool,
                          corrupt_at: int) -> int:
    mismatch, pos = False, 0
    for dst, src, nbytes in copies:
        for at in range(0, nbytes, _FALLBACK_CHUNK):
            step = min(_FALLBACK_CHUNK, nbytes - at)
            before = _crc32c.crc32c(_view(src + at, step))
            value = _crc32c.crc32c(_view(src + at, step), value)
            ctypes.memmove(dst + at, src + at, step)
            if pos <= corrupt_at < pos + step:
                byte = ctypes.c_uint8.from_address(dst + at + corrupt_at - pos)
                byte.value ^= 0x5A
            if verify and _crc32c.crc32c(_view(dst + at, step)) != before:
                mismatch = True
            pos += step
    if mismatch:
        raise CopyMismatch("a copied range does not read back as its source")
    return value


def _check_value(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"a CRC32C value is an int in [0, 2**32), got {value!r}")


def _array(values: list[int]) -> ctypes.Array:
    for v in values:
        if v < 0:
            raise ValueError(f"addresses and sizes must be >= 0, got {v}")
    return (ctypes.c_int64 * len(values))(*values)


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
