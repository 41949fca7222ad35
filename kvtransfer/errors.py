"""The transfer errors, in a module of their own: kvtransfer/layout.py raises one when a
shared-memory pool has no room, and kvtransfer/base.py (which imports the layout) exports
both with the backends' interface."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transport could not be set up or used (unreachable peer, closed object)."""


class KVLayoutMismatch(KVTransferError):
    """The peer's KV layout (model identity, geometry or dtype) differs from ours."""
