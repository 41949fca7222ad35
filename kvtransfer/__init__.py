"""KV-cache data plane between prefill (sender) and decode (receiver) workers.

Backends are chosen by name; each loads its transport library only when chosen:

    sender = kvtransfer.create_sender("zmq", ack_timeout_s=10)
    receiver = kvtransfer.create_receiver("zmq", cache, layout, endpoint="tcp://0.0.0.0:*")

The contract (who calls what, when) is in kvtransfer/base.py.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import (
    KVLayoutMismatch, KVReceiver, KVSender, KVTransferError, ReceiveEvent, ReceiveKind,
    TransferState, TransferStats, TransferStatus, TransferTimes,
)
from .layout import KVCacheBuffer, KVLayout, allocate_cache, dtype_name

# name -> (module, sender class, receiver class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "fake": ("kvtransfer.fake", "FakeSender", "FakeReceiver"),
    "zmq": ("kvtransfer.zmq_backend", "ZmqSender", "ZmqReceiver"),
    "shm": ("kvtransfer.shm_backend", "ShmSender", "ShmReceiver"),
    "grpc": ("kvtransfer.grpc_backend", "GrpcSender", "GrpcReceiver"),
    "dist": ("kvtransfer.dist_backend", "DistSender", "DistReceiver"),
}


def backends() -> list[str]:
    return list(_BACKENDS)


def _load(name: str, index: int) -> Any:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {backends()}")
    module, *classes = _BACKENDS[name]
    return getattr(importlib.import_module(module), classes[index])


def create_sender(name: str, **kwargs: Any) -> KVSender:
    return _load(name, 0)(**kwargs)


def create_receiver(name: str, cache: KVCacheBuffer, layout: KVLayout, **kwargs: Any) -> KVReceiver:
    return _load(name, 1)(cache, layout, **kwargs)


__all__ = [
    "KVCacheBuffer", "KVLayout", "KVLayoutMismatch", "KVReceiver", "KVSender", "KVTransferError",
    "ReceiveEvent", "ReceiveKind", "TransferState", "TransferStats", "TransferStatus", "TransferTimes", "allocate_cache", "backends",
    "create_receiver", "create_sender", "dtype_name",
]
