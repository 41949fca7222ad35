"""Same-host transport: the sender writes straight into the receiver's cache.

The receiver's cache lives in a named POSIX shared-memory segment (allocate_cache(...,
shared_memory_name=...)). Control messages use the zmq framing of zmq_backend.py over an ipc
socket; only headers cross it, never payload bytes:

    sender                                        receiver
    [b"H", layout]                         --->
                                           <---   [b"W", layout, shm name, owner-table name]
    map the cache segment and the owner table
    owner[block_ids] == tag(request)? ----- no --> [b"N", header with sender_error]  (nothing written)
      | yes
    kv_cache[layer, :, block_ids] = payload (one memcpy, the whole transfer)
    [b"N", header with crc32 of payload]   --->   validate the header (expected request, owned
                                                  blocks, fingerprint, dtype, shape), crc32 the
                                           <---   blocks in place, [b"A", ack]

Trust boundary. Writes are one-sided: the receiver cannot refuse bytes before they land, only
refuse to accept them. So:
- The owner table (int64 per block, the owning request's tag, 0 = free; in its own small segment
  that the receiver writes in expect() and clears when a request closes) lets an honest sender
  refuse a misdirected write *before* writing: a foreign or unexpected block id never touches
  the cache, and the notification carries the sender's refusal so the request fails.
- The receiver still validates every notification as if the table did not exist; a failed
  validation or checksum fails the request, and its blocks stay owned by that request until the
  engine frees them, so bad bytes can only ever sit in blocks of a request that is failing.
- Residual window: a sender that passed the owner check just before cancel()/deadline expiry
  may finish that one memcpy afterwards. Engines using shm should therefore keep a cancelled or
  failed request's blocks out of the free pool for a grace period longer than one layer's
  memcpy (milliseconds). The sender is trusted not to ignore the table: shm is for peers in the
  same trust domain (same host, same deployment); use zmq when that does not hold.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from multiprocessing import shared_memory

import torch

from .base import KVTransferError
from .layout import KVCacheBuffer, KVLayout, AttachedSegment, map_shared_tensor
from .message import HandshakeReply, KVHeader
from .receiving import ReceiveTable
from .zmq_backend import NOTIFY, ZmqReceiver, ZmqSender, default_ipc_endpoint


def owner_tag(request_id: str) -> int:
    """A request's non-zero 63-bit tag in the owner table."""
    tag = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return (tag & (2**63 - 1)) or 1


class ShmReceiver(ZmqReceiver):
    def __init__(self, cache: KVCacheBuffer, layout: KVLayout, endpoint: str | None = None) -> None:
        if cache.shm_name is None:
            raise ValueError("shm receiver needs a cache allocated with shared_memory_name=...")
        self._owner_shm = shared_memory.SharedMemory(
            name=f"{cache.shm_name}-own", create=True, size=8 * cache.num_blocks
        )
        self._owners = map_shared_tensor(self._owner_shm, torch.int64, (cache.num_blocks,))
        self._owners.zero_()
        try:
            super().__init__(cache, layout, endpoint or default_ipc_endpoint("tandem-kv-shm"))
        except BaseException:
            self._release_owner_table()
            raise

    def _make_table(self) -> ReceiveTable:
        return ReceiveTable(self.cache, self.layout, on_claim=self._claim, on_release=self._release)

    def _claim(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        self._owners[torch.tensor(block_ids, dtype=torch.long)] = owner_tag(request_id)

    def _release(self, block_ids: tuple[int, ...]) -> None:
        self._owners[torch.tensor(block_ids, dtype=torch.long)] = 0

    def _handshake_reply(self) -> HandshakeReply:
        return HandshakeReply(
            self.layout, self.cache.num_blocks, self.cache.shm_name or "", self._owner_shm.name
        )

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._release_owner_table()

    def _release_owner_table(self) -> None:
        self._owners = torch.empty(0, dtype=torch.int64)
        self._owner_shm.unlink()
        try:
            self._owner_shm.close()
        except BufferError:
            pass  # a view is still alive; unmapped at exit, and the name is already gone


class ShmSender(ZmqSender):
    def __init__(self, ack_timeout_s: float = 30.0, connect_timeout_s: float = 10.0) -> None:
        super().__init__(ack_timeout_s, connect_timeout_s)
        self._segments: list[AttachedSegment] = []
        self._cache: torch.Tensor | None = None
        self._owners: torch.Tensor | None = None

    def _on_handshake(self, reply: HandshakeReply, endpoint: str) -> None:
        if not reply.shm_name or not reply.owner_shm_name:
            raise KVTransferError(f"receiver at {endpoint} has no shared-memory cache (not an shm receiver?)")
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

    def _frames(self, header: KVHeader, payload: torch.Tensor) -> list:
        assert self._cache is not None and self._owners is not None  # set by connect()
        bad = [b for b in header.block_ids if not 0 <= b < self._owners.numel()]
        if bad:
            return [NOTIFY, _with_error(header, f"block ids {bad} out of range")]
        idx = torch.tensor(header.block_ids, dtype=torch.long)
        tag = owner_tag(header.request_id)
        if not bool((self._owners[idx] == tag).all()):
            foreign = [b for b, t in zip(header.block_ids, self._owners[idx].tolist()) if t != tag]
            return [NOTIFY, _with_error(header, f"owner table: blocks {foreign} not owned by {header.request_id}")]
        self._cache[header.layer].index_copy_(1, idx, payload)
        return [NOTIFY, header.encode()]

    def close(self) -> None:
        super().close()
        self._unmap()

    def _unmap(self) -> None:
        self._cache = self._owners = None
        for shm in self._segments:
            try:
                shm.close()
            except BufferError:
                pass  # a tensor view escaped; the mapping goes at process exit
        self._segments.clear()


def _with_error(header: KVHeader, error: str) -> bytes:
    return replace(header, sender_error=error).encode()
