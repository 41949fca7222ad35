"""What a KV cache looks like, and where it lives.

The decode worker's paged cache is one tensor; a transfer unit is one layer's K and V for a
list of blocks:

    kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
                       |   `-- block ids, the same for every layer of a request
                       `-- 0 = K, 1 = V
    payload  [2, n, block_size, num_kv_heads, head_dim] == kv_cache[layer, :, block_ids]

kvtransfer knows models only through `KVLayout`: shapes, dtype and an opaque model id. Two
workers may exchange KV only if their layouts' fingerprints are equal. The fingerprint digests
every field, the element type included: a bf16 cache and an fp32 cache never pair (a sender
refuses at connect, naming the differing fields; the coordinator refuses at registration,
comparing `KVLayout.description`, which spells the dtype and geometry next to the digest).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
from dataclasses import asdict, dataclass, field
from functools import cached_property
from multiprocessing import shared_memory

import torch

from common import shm_segments

from .errors import KVTransferError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The DTYPES key of a torch dtype (e.g. a cache tensor's), for KVLayout.dtype."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"no KV layout dtype for {dtype}; supported: {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of a paged KV cache, plus the identity of the model that fills it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str  # a key of DTYPES
    model_id: str  # e.g. a checkpoint's sha256 or "HuggingFaceTB/SmolLM2-135M-Instruct@rev"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"KVLayout.model_id must be a non-empty str, got {self.model_id!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @cached_property  # frozen, so computed once (cached_property bypasses __setattr__)
    def fingerprint(self) -> str:
        """Stable hex digest of every field; equal fingerprints mean interchangeable caches."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

    @property
    def description(self) -> str:
        """What a worker advertises to the coordinator as its layout (proto WorkerInfo's
        kv_layout_fingerprint): readable dtype and geometry, then the fingerprint, so equal
        strings mean equal layouts and a refusal names what differs at a glance."""
        return (f"{self.dtype} L{self.num_layers} H{self.num_kv_heads} D{self.head_dim} "
                f"B{self.block_size} {self.fingerprint}")

    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) for one layer."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block_per_layer(self) -> int:
        """K and V of one block for one layer."""
        return 2 * math.prod(self.block_shape()) * self.itemsize

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, *self.block_shape())

    def payload_nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block_per_layer()

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, *self.block_shape())

    def cache_nbytes(self, num_blocks: int) -> int:
        return self.num_layers * self.payload_nbytes(num_blocks)

    def diff(self, other: KVLayout) -> list[str]:
        """Fields that differ, as 'name: ours != theirs' (empty when equal)."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass
class KVCacheBuffer:
    """The cache tensor and the memory that backs it.

    With a shared-memory name the tensor lives in a POSIX segment (/dev/shm/<name>) that a
    same-host sender can map and write into. The creator owns the segment: `close()` unlinks
    it. Close it exactly once, after every user of `tensor` is done.
    """

    layout: KVLayout
    num_blocks: int
    tensor: torch.Tensor  # kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    shm_name: str | None = None
    _shm: shared_memory.SharedMemory | None = field(default=None, repr=False)

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self.tensor = torch.empty(0, dtype=self.layout.torch_dtype)  # drop our view first
        unlink_segment(shm)
        try:
            shm.close()
        except BufferError:
            # Someone still holds a view of the mapping; it is unmapped at process exit. The name
            # is already unlinked, so nothing leaks in /dev/shm.
            pass

    def __enter__(self) -> KVCacheBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_segment(shm: shared_memory.SharedMemory) -> None:
    """Unlink a segment we created; its name may be gone already (common/lifeline.py unlinks a
    worker's segments when its launcher dies, before the worker's own orderly stop)."""
    try:
        shm.unlink()
    except FileNotFoundError:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # as unlink() would have


def allocate_cache(
    layout: KVLayout, num_blocks: int, shared_memory_name: str | None = None
) -> KVCacheBuffer:
    """A zeroed cache for `num_blocks` blocks, in private memory or a new named shm segment."""
    if not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    shape = layout.cache_shape(num_blocks)
    if shared_memory_name is None:
        return KVCacheBuffer(layout, num_blocks, torch.zeros(shape, dtype=layout.torch_dtype))
    nbytes = layout.cache_nbytes(num_blocks)
    shm = create_segment(shared_memory_name, nbytes, "KV pool")
    try:
        tensor = map_shared_tensor(shm, layout.torch_dtype, shape)
        tensor.zero_()
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return KVCacheBuffer(layout, num_blocks, tensor, shared_memory_name, shm)


def create_segment(name: str, nbytes: int, what: str) -> shared_memory.SharedMemory:
    """A new shared-memory segment of `nbytes` whose pages are reserved now. A tmpfs segment
    is sparse until written, so one past /dev/shm's free space is made without complaint and
    the first write beyond it dies with SIGBUS (a container's /dev/shm is 64 MiB unless given
    more; two workers starting at once can each see room for themselves): posix_fallocate
    takes the pages at once or fails with ENOSPC, which becomes an error that says so."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    fd = getattr(shm, "_fd", -1)  # POSIX only; elsewhere nothing is reserved
    if fd < 0 or not nbytes:
        return shm
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        shm.close()
        shm.unlink()
        if e.errno != errno.ENOSPC:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
                return shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            raise
        free = shm_segments.free_bytes()
        have = "" if free is None else f" and {shm_segments.SHM_DIR} has {free // 2**20:,} MiB free"
        raise KVTransferError(
            f"the shared-memory {what} needs {-(-nbytes // 2**20):,} MiB{have}: give the host "
            "or container more shared memory (docker --shm-size), make the pool smaller "
            "(--num-blocks), or use --kv-backend zmq") from None
    return shm


def map_shared_tensor(
    shm: shared_memory.SharedMemory | AttachedSegment, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor view of a segment's first prod(shape) elements (no copy)."""
    count = math.prod(shape)
    return torch.frombuffer(shm.buf, dtype=dtype, count=count).view(shape)


class AttachedSegment:
    """A mapping of someone else's shared-memory segment; closing it never unlinks it."""

    def __init__(self, name: str) -> None:
        self.name = name
        if os.path.isdir(_DEV_SHM):
            # Linux: map /dev/shm/<name> ourselves. multiprocessing.SharedMemory(create=False)
            # would register the segment with the resource tracker (Python < 3.13), which is
            # shared with spawned children and would unlink the *creator's* segment at our exit.
            with open(os.path.join(_DEV_SHM, name.lstrip("/")), "r+b") as f:
                self._map: mmap.mmap | shared_memory.SharedMemory = mmap.mmap(f.fileno(), 0)
            self.buf = memoryview(self._map)
        else:
            self._map = shared_memory.SharedMemory(name=name, create=False)
            self.buf = self._map.buf

    def close(self) -> None:
        """Unmap; BufferError if a tensor view of it is still alive (the caller decides)."""
        self.buf.release()
        self._map.close()


_DEV_SHM = "/dev/shm"
