"""Same-host transport: the sender's I/O thread writes straight into the receiver's cache.

The receiver's cache lives in a named POSIX shared-memory segment (allocate_cache(...,
shared_memory_name=...)). Control uses the frames of zmq_backend.py over an ipc socket; only
headers cross it, never payload bytes:

    sender (its I/O thread = the writer)          receiver
    [H, pid + start time]                  --->   remember them for the fence
                                           <---   [W, layout, shm name, owner-table name]
    map the cache segment and the owner table
    [G, transfer]                          --->
                                           <---   [g, skip_blocks, block ids]
    owner[block ids] == tag(transfer)? --- no --> abort unit, nothing written
      | yes
    (pre_write_hook: tests hold the writer here)
    one native pass over the unit's runs of ids (kernels/copy_crc32c.py): each word of
      the source is loaded once, folded into the crc32c and stored into kv_cache[layer,
      kv, ids] (verify="sender": each 24 KiB chunk is then compared with its source while
      both are in cache, and a chunk that does not read back fails the unit)
    [N, header with the crc]               --->   validate the header (owner, shape, layout);
                                           <---   verify="receiver": crc32c the blocks in
                                                  place first; [A, ack]

Integrity: the receiver's `verify` (ShmReceiver(verify=...), told to the writer in the
handshake) says who reads the written blocks a second time. Every mode computes the crc32c in
the copy loop, from the very registers that are stored, and carries it in the header.
- "copy" (the default): nobody. The writer streams its stores past the cache (movnti), so a
  copy out of memory moves two lines per line copied instead of the three an ordinary store
  costs (it reads its destination first): the transfer beats a torch copy of the same bytes.
  What is not checked is that memory holds what the core stored (ECC's job) and the writer's
  address arithmetic (tests/kvtransfer check it; the receiver still checks every header's
  ids against its grant).
- "sender": the writer compares each chunk with its source right after the copy, both still
  in cache (ordinary stores): a copy that did not land fails the unit. A third pass over the
  bytes on the writer's core: ~0.85x a torch copy.
- "receiver": the receiver crc32c's the blocks in place before it acks each unit, an
  end-to-end check by the other process (it also catches a writer that wrote the wrong
  blocks); the writer streams, in units of at most RECEIVER_VERIFY_UNIT_BYTES so the check
  of one unit overlaps the copy of the next. Still a third pass, on the receiver's core,
  sharing the host's memory bandwidth with the copy.
benchmarks.bench_kvtransfer prints all three (shm, shm-sverify, shm-rverify).

Block reuse after a cancel or failure (the reason for the revocation round trip). Writes are
one-sided: the receiver cannot stop bytes that a sender has decided to write. The owner table
(int64 per block, the owning transfer's tag, 0 = free; its own small segment) stops an honest
sender *before* it writes: the receiver clears a transfer's entries the moment it closes. But a
writer that passed the check an instant earlier still completes its memcpy afterwards, however
long it was descheduled in between. So the receiver does not report RELEASED on closing:

    receiver: clear owner[blocks]; [R, revoke]  --->  writer thread, between two writes (so
                                                      any write that passed the check is done):
                                                      drop the transfer's queued units,
                                           <---       [r, revoked]
    receiver: RELEASED (the engine may reuse the blocks)

The writer's finish, abort or goodbye (close) is equally final: it is sent by the same thread
after its last write. If the sender process is gone (pid and start time from its handshake,
checked every ~100 ms while anything is held), it writes nothing more either: RELEASED. There
is no timer: a live sender that never answers keeps the blocks held, which is a leak to
investigate, never a corruption. The receiver still validates every notification (header and
crc32c in place); a failed check fails the transfer, and its blocks stay held until RELEASED,
so bad bytes only ever sit in blocks of a transfer that is failing.

Trust: the sender is trusted to honour the owner table and to answer revocations; shm is for
peers in the same trust domain (same host, same deployment); use zmq when that does not hold.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.copy_crc32c import CopyMismatch, copy_crc32c

from .auth import KVAuth
from .base import KVTransferError
from .layout import (
    AttachedSegment, KVCacheBuffer, KVLayout, create_segment, map_shared_tensor, unlink_segment,
)
from .message import HandshakeReply, KVHeader, block_runs
from .receive_table import ReceiveTable
from .transfer import OutgoingTransfer
from .zmq_backend import NOTIFY, ZmqReceiver, ZmqSender, default_ipc_endpoint

FENCE_INTERVAL_S = 0.1
# The most bytes one unit writes when several layers are queued: bounds how long a revocation
# waits for the write in progress and keeps acks flowing while a long prompt streams.
MAX_UNIT_BYTES = 64 << 20
# ... when the receiver checks each unit in place: its check of one unit runs while the next
# is copied, so the last unit's check is the tail the transfer waits for (of 4/8/16/32/64 MiB
# at 2,048 tokens on a 2-core Xeon, 16 and 32 ran alike and best: smaller units cost more
# Python per unit than their shorter tail saves, larger ones a longer tail).
RECEIVER_VERIFY_UNIT_BYTES = 16 << 20


def owner_tag(transfer_id: str) -> int:
    """A transfer's non-zero 63-bit tag in the owner table."""
    tag = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")
    return (tag & (2**63 - 1)) or 1


VERIFY_MODES = ("copy", "sender", "receiver")


class ShmReceiver(ZmqReceiver):
    def __init__(self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str | None = None,
                 verify: str = "copy", auth: KVAuth | None = None) -> None:
        if cache.shm_name is None:
            raise ValueError("shm receiver needs a cache allocated with shared_memory_name=...")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.verify = verify
        self._owner_shm = create_segment(f"{cache.shm_name}-own", 8 * cache.num_blocks,
                                         "KV owner table")
        self._owners = map_shared_tensor(self._owner_shm, torch.int64, (cache.num_blocks,))
        self._owners.zero_()
        self._next_fence = 0.0
        try:
            super().__init__(cache, layout, endpoint or default_ipc_endpoint("tandem-kv-shm"), auth)
        except BaseException:
            self._release_owner_table()
            raise

    def _make_table(self) -> ReceiveTable:
        return ReceiveTable(self.cache, self.layout, self._deliver, "shm", one_sided=True,
                            on_claim=self._claim, on_release=self._unclaim,
                            verify_in_place=self.verify == "receiver", auth=self.auth)

    def _claim(self, transfer_id: str, block_ids: tuple[int, ...]) -> None:
        if block_ids:
            self._owners[torch.tensor(block_ids, dtype=torch.long)] = owner_tag(transfer_id)

    def _unclaim(self, block_ids: tuple[int, ...]) -> None:
        if block_ids:
            self._owners[torch.tensor(block_ids, dtype=torch.long)] = 0

    def _handshake_reply(self) -> HandshakeReply:
        return HandshakeReply(
            self.layout, self.cache.num_blocks, self.cache.shm_name or "", self._owner_shm.name,
            max_unit_layers=self.layout.num_layers, shm_verify=self.verify,
        )

    def _on_idle(self) -> None:
        now = time.monotonic()
        if now >= self._next_fence:
            self._next_fence = now + FENCE_INTERVAL_S
            self.table.check_fences()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._release_owner_table()

    def _release_owner_table(self) -> None:
        self._owners = torch.empty(0, dtype=torch.int64)
        unlink_segment(self._owner_shm)
        try:
            self._owner_shm.close()
        except BufferError:
            pass  # a view is still alive; unmapped at exit, and the name is already gone


class ShmSender(ZmqSender):
    """`pre_write_hook` is a test seam: called on the writer thread with the unit's header (its
    checksum still 0: it is computed during the copy) after the owner-table check passed and
    before the memcpy, so a test can hold a writer inside the window that the revocation
    protocol closes."""

    backend = "shm"

    def __init__(
        self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
        pre_write_hook: Callable[[KVHeader], None] | None = None, auth: KVAuth | None = None,
    ) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s, auth)
        self.pre_write_hook = pre_write_hook
        self._segments: list[AttachedSegment] = []
        self._cache: torch.Tensor | None = None
        self._owners: torch.Tensor | None = None
        self._owner_view: np.ndarray | None = None  # numpy view of _owners
        self._verify = "sender"  # the receiver's mode, from its handshake

    def _on_handshake(self, reply: HandshakeReply, endpoint: str) -> None:
        if not reply.shm_name or not reply.owner_shm_name:
            raise KVTransferError(f"receiver at {endpoint} has no shared-memory cache (not an shm receiver?)")
        if reply.shm_verify not in VERIFY_MODES:
            raise KVTransferError(f"receiver at {endpoint} asks for an unknown shm check {reply.shm_verify!r}")
        try:
            cache_shm = AttachedSegment(reply.shm_name)
            self._segments.append(cache_shm)
            owner_shm = AttachedSegment(reply.owner_shm_name)
            self._segments.append(owner_shm)
        except FileNotFoundError as e:
            self._unmap()
            raise KVTransferError(f"shm segment of {endpoint} not found (another host?): {e}") from e
        shape = reply.layout.cache_shape(reply.num_blocks)
        self._cache = map_shared_tensor(cache_shm, reply.layout.torch_dtype, shape)
        self._owners = map_shared_tensor(owner_shm, torch.int64, (reply.num_blocks,))
        self._owner_view = self._owners.numpy()  # fancy indexing without a torch op per unit
        self._verify = reply.shm_verify

    def _io_unit_layers(self, layer_nbytes: int) -> int:
        cap = RECEIVER_VERIFY_UNIT_BYTES if self._verify == "receiver" else MAX_UNIT_BYTES
        return max(1, min(self._max_unit_layers, cap // max(1, layer_nbytes)))

    def _io_transmit(
        self, t: OutgoingTransfer, layer: int, sources: tuple[torch.Tensor, ...],
        src_ids: tuple[int, ...], dst_ids: tuple[int, ...], seq: int,
    ) -> str:
        cache, owners = self._cache, self._owners
        assert cache is not None and owners is not None  # set by connect()
        if min(dst_ids) < 0 or max(dst_ids) >= owners.numel():
            bad = [b for b in dst_ids if not 0 <= b < owners.numel()]
            return f"granted block ids {bad} out of range"
        if any(s.device.type != "cpu" or not s.is_contiguous() for s in sources):
            # rare: a source the runs cannot slice
            sources = tuple(self.gather(s, src_ids) for s in sources)
            src_ids = tuple(range(len(src_ids)))
        tag = owner_tag(t.transfer_id)
        # The owner check, then (nothing but the test hook) the write: the revocation protocol
        # covers whatever time passes in between.
        held = self._owner_view[list(dst_ids)]
        if (held != tag).any():
            foreign = [b for b, owner in zip(dst_ids, held.tolist()) if owner != tag]
            return f"owner table: blocks {foreign} not owned by {t.transfer_id}"
        count = len(sources)
        if self.pre_write_hook is not None:
            self.pre_write_hook(self.data_header(t, layer, dst_ids, None, seq, crc=0, layer_count=count))
        # One native pass per unit (kernels/copy_crc32c.py, GIL released): each word of the
        # source is read once, folded into the crc32c and stored into the shared cache; the
        # receiver's mode says whether the stores stream past the cache or each 24 KiB chunk
        # is compared with its source while both are in cache. Bounds were checked against
        # both tensors: dst ids above, src ids by send(); layer + count by the loop.
        itemsize = cache.element_size()
        block_bytes = cache[0, 0, 0].numel() * itemsize
        runs = list(block_runs(src_ids, dst_ids))
        copies = []
        for i, source in enumerate(sources):
            for kv in (0, 1):
                src_base = source.data_ptr() + kv * source.stride(0) * itemsize
                dst_base = cache.data_ptr() + ((layer + i) * cache.stride(0) + kv * cache.stride(1)) * itemsize
                copies += [(dst_base + dst * block_bytes, src_base + src * block_bytes, length * block_bytes)
                           for src, dst, length in runs]
        read_back = self._verify == "sender"
        try:
            crc = copy_crc32c(copies, verify=read_back, stream=not read_back)
        except CopyMismatch:
            return f"layers {layer}-{layer + count - 1}: the copy into the shared cache does not read back"
        self._send([NOTIFY, self.data_header(t, layer, dst_ids, None, seq, crc=crc,
                                             layer_count=count).encode()])
        return ""

    def _io_close(self) -> None:
        super()._io_close()
        self._unmap()

    def close(self) -> None:
        super().close()
        self._unmap()

    def _unmap(self) -> None:
        self._cache = self._owners = self._owner_view = None
        for shm in self._segments:
            try:
                shm.close()
            except BufferError:
                pass  # a tensor view escaped; the mapping goes at process exit
        self._segments.clear()

