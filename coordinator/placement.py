"""Where a request runs: pure functions over worker snapshots, so policy is testable alone.

    decode worker   the one with the most free KV blocks left after this prompt's need,
                    then the fewest running requests (our own count when a heartbeat lags)
    prefill         remote on the prefill worker with the fewest queued prefill tokens, or
                    local on the decode worker (Generate with remote_prefill=false) when:
                      - the decode worker is colocated (it prefills everything), or
                      - no live prefill worker can write into its KV layout, or
                      - the prompt is short (<= prefill_threshold tokens) and the decode
                        worker's token budget has room for it beside its running decodes
                        (conditional disaggregation: moving KV costs more than it saves)

A prefill worker is compatible with a decode worker only when their kv_layout_fingerprint and
kv_backend are equal: the sender must write exactly the receiver's cache layout through a
transport the receiver listens on.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from coordinator.registry import WorkerSnapshot


@dataclass(frozen=True)
class Placement:
    decode: WorkerSnapshot
    prefill: WorkerSnapshot | None  # None = prefill locally on the decode worker
    reason: str  # why local or remote prefill, for logs and tests


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _running(w: WorkerSnapshot) -> int:
    return max(w.load.num_running + w.load.num_waiting, w.assigned_requests)


def _free_after(w: WorkerSnapshot, prompt_tokens: int) -> int:
    """KV blocks left after this prompt (+1 token for the first output); unknown pool = 0."""
    if w.load.num_blocks <= 0:
        return 0
    return w.load.num_free_blocks - blocks_needed(prompt_tokens + 1, w.load.block_size)


def choose_decode(workers: Sequence[WorkerSnapshot], prompt_tokens: int) -> WorkerSnapshot | None:
    """Most free blocks after the prompt's need, then fewest running. A worker without room is
    still chosen when none has any: its scheduler queues the request until blocks free up."""
    candidates = [w for w in workers if w.role in ("decode", "colocated")]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (-_free_after(w, prompt_tokens), _running(w),
                                          w.worker_id))


def compatible_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot,
                       exclude: Collection[str] = ()) -> list[WorkerSnapshot]:
    return [w for w in workers
            if w.role == "prefill" and w.worker_id not in exclude
            and w.kv_layout_fingerprint == decode.kv_layout_fingerprint
            and w.kv_backend == decode.kv_backend]


def choose_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot,
                   exclude: Collection[str] = ()) -> WorkerSnapshot | None:
    """Fewest queued prefill tokens (its report plus what we sent since), among compatible ones."""
    candidates = compatible_prefill(workers, decode, exclude)
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load.queued_prefill_tokens + w.assigned_prefill_tokens,
                                          w.worker_id))


def has_spare_budget(decode: WorkerSnapshot, prompt_tokens: int, default_budget: int) -> bool:
    """Whether one forward pass of the decode worker fits its decodes, its queued prefill and
    this prompt: then prefilling here costs the running requests at most one larger step."""
    budget = decode.load.max_num_batched_tokens or default_budget
    used = _running(decode) + decode.load.queued_prefill_tokens + decode.assigned_prefill_tokens
    return used + prompt_tokens <= budget


def place(workers: Sequence[WorkerSnapshot], prompt_tokens: int, *, prefill_threshold: int,
          default_budget: int) -> Placement | None:
    """None when no decode-capable worker is alive."""
    decode = choose_decode(workers, prompt_tokens)
    if decode is None:
        return None
    if decode.role == "colocated":
        return Placement(decode, None, "colocated worker")
    prefill = choose_prefill(workers, decode)
    if prefill is None:
        return Placement(decode, None, "no compatible prefill worker")
    if prompt_tokens <= prefill_threshold and has_spare_budget(decode, prompt_tokens,
                                                               default_budget):
        return Placement(decode, None, "short prompt, decode worker has spare budget")
    return Placement(decode, prefill, "remote prefill")


def concurrency_limit(workers: Sequence[WorkerSnapshot], per_worker: int) -> int:
    """Requests the live decode-capable workers can hold at once: `per_worker` each, fewer on a
    worker whose KV pool is smaller than that many blocks (a request needs at least one)."""
    total = 0
    for w in workers:
        if w.role in ("decode", "colocated"):
            total += min(per_worker, w.load.num_blocks) if w.load.num_blocks > 0 else per_worker
    return total
