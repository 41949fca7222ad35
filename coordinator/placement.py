"""Where a request runs: pure functions over worker snapshots, so policy is testable alone.

Prefix-aware, after Dynamo's KV router: each worker publishes the chain hashes of the blocks its
prefix cache holds (WorkerLoad.cached_hashes); a prompt's `overlap` on a worker is how many of
its leading full blocks that worker holds. Costs are in KV blocks, lowest wins (scaled by the
worker's block size, i.e. counted in token slots, so that workers of different block sizes
compare):

    decode worker   cost = W * (queued prefill + uncached prompt blocks)     work to compute
                         + used blocks + (unseen + 1) * new blocks            KV it will hold
                    among those with room for the prompt first (a worker without room is still
                    chosen when none has any: its scheduler queues the request); ties: fewest
                    running requests
    prefill worker  cost = queued prefill blocks + prompt blocks it lacks; among the ones that
                    can write into the decode worker's KV layout
    prefill         remote on that prefill worker, or local on the decode worker (Generate with
                    remote_prefill=false) when:
                      - the decode worker is colocated (it prefills everything), or
                      - no live prefill worker can write into its KV layout, or
                      (and never else for a request scoring its prompt, `scored`), or
                      - the prompt's part the decode worker has not cached is short
                        (<= prefill_threshold tokens), its token budget has room for that
                        beside its running decodes, and it would compute them, behind its
                        queue, within LOCAL_PREFILL_SLOWDOWN times the time the prefill
                        worker would, behind its own, each at its measured cost per prompt
                        token (conditional disaggregation: moving KV costs more than it
                        saves, unless the decode format is much slower at prompts;
                        local_prefill_pays)

The terms, per worker (block size `bs` its own):
    uncached     the prompt's blocks minus the overlap: computed, and moved to a decode worker
    new blocks   fresh blocks the request takes there: blocks(prompt + 1 token) - overlap
    used         num_blocks - num_free_blocks, the KV its running requests hold, less the
                 blocks of this coordinator's requests that ended there since that status
                 and were counted by it (released_blocks: a status is up to a heartbeat old,
                 longer than a short request lives, and a worker whose request just ended
                 must not look busy)
    unseen       requests this coordinator sent it that its last heartbeat did not count yet
                 (assigned - reported running and waiting, less the released ones that
                 status still counts), each guessed as large as this
                 one: heartbeats are up to an interval old, and a burst sharing one hot prefix
                 must not all land on the worker that holds it before its load shows
    queued       prompt tokens it has accepted and not prefilled yet (its report plus ours) / bs

W (OVERLAP_WEIGHT = 1, Dynamo's default `kv-overlap-score-weight`) weighs a block to compute
against a block of KV held. Every cached block also saves a fresh block, so a block of overlap
is worth W + 1 = 2 blocks of load: a worker holding 32 of the prompt's blocks wins over a cold
one unless it holds 64 blocks more of other requests' KV (four 256-token conversations at block
size 16), or as much in requests its heartbeat has not shown yet. A larger W favours cache
hits (TTFT), a smaller one even load (ITL); 0 leaves only the saved fresh blocks.

A worker's cache can serve at most the full blocks before the prompt's last token (the engine
always computes the last token for its logits, BlockManager._lookup), so only those are hashed,
once per block size per placement, and only when some worker publishes hashes.

A prefill worker is compatible with a decode worker only when their kv_layout_fingerprint and
kv_backend are equal: the sender must write exactly the receiver's cache layout through a
transport the receiver listens on.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from coordinator.registry import WorkerSnapshot
from common.block_hash import block_hashes

OVERLAP_WEIGHT = 1.0
# How much slower per prompt token a decode worker's local prefill may be than the prefill
# worker's and still be chosen: it saves the KV transfer and a round trip between workers.
# Each worker measures its own cost (engine/prefill_cost.py). Measured, Sapphire Rapids class,
# one thread per worker: SmolLM2-135M 3.8 ms a token in int4 on the decode worker against 3.9
# in fp32 on the prefill worker (local); a 1.07B LLaMA 20 ms in int4 against 8 in bf16
# (remote: 8 short chats prefilled locally had kept its decode worker busy for ~5 s).
LOCAL_PREFILL_SLOWDOWN = 1.5


@dataclass(frozen=True)
class Placement:
    decode: WorkerSnapshot
    prefill: WorkerSnapshot | None  # None = prefill locally on the decode worker
    reason: str  # why local or remote prefill and what was cached, for logs and tests
    overlap_blocks: int = 0  # prompt blocks the decode worker's prefix cache holds
    prefill_overlap_blocks: int = 0  # ... and the prefill worker's; 0 for a local prefill


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Prompt:
    """A prompt's token ids and, computed on first use per block size, its blocks' chain
    hashes: one placement hashes the prompt once however many workers it scores."""

    def __init__(self, token_ids: Sequence[int], cache_salt: bytes = b"") -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt  # the tenant's: workers hash its blocks with it
        self._hashes: dict[int, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def cacheable_blocks(self, block_size: int) -> int:
        """Full blocks before the last token: the most a prefix cache can serve."""
        return max(0, len(self.token_ids) - 1) // block_size

    def overlap(self, w: WorkerSnapshot) -> int:
        """Leading blocks of the prompt that `w`'s prefix cache holds."""
        cached = w.load.cached_hashes
        if not cached:
            return 0
        bs = w.load.block_size
        hashes = self._hashes.get(bs)
        if hashes is None:
            hashes = self._hashes[bs] = block_hashes(self.token_ids[:-1], bs, self.cache_salt)
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n


def _running(w: WorkerSnapshot) -> int:
    return max(w.load.num_running + w.load.num_waiting, w.assigned_requests)


def _has_room(w: WorkerSnapshot, prompt_tokens: int) -> bool:
    """Free blocks for the whole prompt (+1 token for the first output). Cached blocks do not
    count against it: a cached block that sits free is taken from the free list all the same.
    A pool not reported yet counts as having room."""
    if w.load.num_blocks <= 0:
        return True
    return w.load.num_free_blocks >= blocks_needed(prompt_tokens + 1, w.load.block_size)


def _queued_blocks(w: WorkerSnapshot) -> float:
    return (w.load.queued_prefill_tokens + w.assigned_prefill_tokens) / w.load.block_size


def decode_cost(w: WorkerSnapshot, prompt_tokens: int, overlap: int,
                overlap_weight: float = OVERLAP_WEIGHT) -> float:
    """In KV blocks times the block size; see the module docstring."""
    bs = w.load.block_size
    uncached = blocks_needed(prompt_tokens, bs) - overlap
    new = blocks_needed(prompt_tokens + 1, bs) - overlap
    used = w.load.num_blocks - w.load.num_free_blocks if w.load.num_blocks > 0 else 0
    # Ended since the status that counts them (it still counts them as running too).
    used = max(0, used - w.released_blocks)
    reported = max(0, w.load.num_running + w.load.num_waiting - w.released_requests)
    unseen = max(0, w.assigned_requests - reported)
    return bs * (overlap_weight * (_queued_blocks(w) + uncached) + used + (unseen + 1) * new)


def prefill_cost(w: WorkerSnapshot, prompt_tokens: int, overlap: int) -> float:
    """Blocks of prefill ahead of and in this prompt on `w`, times the block size."""
    bs = w.load.block_size
    return bs * (_queued_blocks(w) + blocks_needed(prompt_tokens, bs) - overlap)


def choose_decode(workers: Sequence[WorkerSnapshot], prompt: Prompt,
                  overlap_weight: float = OVERLAP_WEIGHT) -> tuple[WorkerSnapshot, int] | None:
    """The decode-capable worker of lowest cost and the prompt's overlap there."""
    scored = []
    n = len(prompt)
    for w in workers:
        if w.role in ("decode", "colocated"):
            overlap = prompt.overlap(w)
            key = (not _has_room(w, n), decode_cost(w, n, overlap, overlap_weight),
                   _running(w), w.worker_id)
            scored.append((key, w, overlap))
    if not scored:
        return None
    _, w, overlap = min(scored, key=lambda s: s[0])
    return w, overlap


def compatible_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot,
                       exclude: Collection[str] = ()) -> list[WorkerSnapshot]:
    return [w for w in workers
            if w.role == "prefill" and w.worker_id not in exclude
            and w.kv_layout_fingerprint == decode.kv_layout_fingerprint
            and w.kv_backend == decode.kv_backend]


def choose_prefill(workers: Sequence[WorkerSnapshot], decode: WorkerSnapshot, prompt: Prompt,
                   exclude: Collection[str] = ()) -> tuple[WorkerSnapshot, int] | None:
    """The compatible prefill worker with the least prefill ahead of and in this prompt (its
    queue, reported plus what we sent since, and the blocks it has not cached), and the
    prompt's overlap there."""
    scored = []
    for w in compatible_prefill(workers, decode, exclude):
        overlap = prompt.overlap(w)
        scored.append(((prefill_cost(w, len(prompt), overlap), w.worker_id), w, overlap))
    if not scored:
        return None
    _, w, overlap = min(scored, key=lambda s: s[0])
    return w, overlap


def has_spare_budget(decode: WorkerSnapshot, prompt_tokens: int, default_budget: int) -> bool:
    """Whether one forward pass of the decode worker fits its decodes, its queued prefill and
    this prompt (its uncached part): then prefilling here costs the running requests at most
    one larger step."""
    budget = decode.load.max_num_batched_tokens or default_budget
    used = _running(decode) + decode.load.queued_prefill_tokens + decode.assigned_prefill_tokens
    return used + prompt_tokens <= budget


def local_prefill_pays(decode: WorkerSnapshot, prefill: WorkerSnapshot, tokens: int) -> bool:
    """Whether the prompt's `tokens` would be computed on the decode worker within
    LOCAL_PREFILL_SLOWDOWN times the time the prefill worker would take, each behind its own
    queue of prompt tokens (reported, plus what this coordinator sent since) at its own
    measured cost per token. Unknown costs (a worker that has not reported one) leave the
    choice to the token rule alone."""
    local, remote = decode.load.prefill_token_seconds, prefill.load.prefill_token_seconds
    if local <= 0.0 or remote <= 0.0:
        return True
    return (_queued_prompt(decode) + tokens) * local <= LOCAL_PREFILL_SLOWDOWN * (
        _queued_prompt(prefill) + tokens) * remote


def local_prefill_stall_fits(decode: WorkerSnapshot, tokens: int, max_stall_s: float) -> bool:
    """Whether prefilling `tokens` on the decode worker delays its running streams by at most
    max_stall_s: every step that carries a chunk of the prompt takes that chunk's time longer,
    so over the prompt the streams lose its tokens at the worker's measured cost, after the
    local prefills this coordinator has already sent there (a burst of short prompts is
    weighed together, not each alone). A worker with
    nothing running loses nothing; an unknown cost leaves the choice to the token rule.
    Running means this coordinator's requests there now (assigned_requests, exact at every
    moment), not the worker's last heartbeat: that one still counts a lone client's previous
    request, finished a moment ago, and would send each of its prompts remote. Streams of
    another coordinator sharing the worker are not weighed."""
    if decode.assigned_requests == 0 or decode.load.prefill_token_seconds <= 0.0:
        return True
    return (decode.assigned_prefill_tokens + tokens) * decode.load.prefill_token_seconds <= max_stall_s


def _queued_prompt(w: WorkerSnapshot) -> int:
    return w.load.queued_prefill_tokens + w.assigned_prefill_tokens


def place(workers: Sequence[WorkerSnapshot], prompt_ids: Sequence[int], *,
          prefill_threshold: int, default_budget: int,
          overlap_weight: float = OVERLAP_WEIGHT, cache_salt: bytes = b"",
          scored: bool = False, max_stall_s: float = math.inf) -> Placement | None:
    """None when no decode-capable worker is alive. scored: the request wants its prompt
    tokens' logprobs (echo, lm-eval's loglikelihood): prefilled on a prefill worker whenever one
    is compatible, in the prefill format, whatever the queues, so that a prompt scores the same
    alone or in a batch (a local prefill would score it in the decode format). max_stall_s:
    the most a local prefill may delay the decode worker's running streams
    (local_prefill_stall_fits; CoordinatorConfig.local_prefill_max_stall_s)."""
    prompt = Prompt(prompt_ids, cache_salt)
    chosen = choose_decode(workers, prompt, overlap_weight)
    if chosen is None:
        return None
    decode, overlap = chosen
    n, bs = len(prompt), decode.load.block_size
    cached = f"{overlap} of {prompt.cacheable_blocks(bs)} blocks cached on {decode.worker_id}"
    if decode.role == "colocated":
        return Placement(decode, None, "colocated worker" + (f", {cached}" if overlap else ""),
                         overlap)
    remote = choose_prefill(workers, decode, prompt)
    if remote is None:
        return Placement(decode, None, "no compatible prefill worker", overlap)
    uncached_tokens = n - overlap * bs
    prefill, prefill_overlap = remote
    if (not scored and uncached_tokens <= prefill_threshold
            and has_spare_budget(decode, uncached_tokens, default_budget)
            and local_prefill_pays(decode, prefill, uncached_tokens)
            and local_prefill_stall_fits(decode, uncached_tokens, max_stall_s)):
        return Placement(decode, None, f"short uncached part ({uncached_tokens} tokens), decode "
                         f"worker has spare budget; {cached}", overlap)
    return Placement(decode, prefill, f"remote prefill on {prefill.worker_id} ({prefill_overlap} "
                     f"blocks cached there), {cached}", overlap, prefill_overlap)


def concurrency_limit(workers: Sequence[WorkerSnapshot], per_worker: int) -> int:
    """Requests the live decode-capable workers can hold at once: `per_worker` each, fewer on a
    worker whose KV pool is smaller than that many blocks (a request needs at least one)."""
    total = 0
    for w in workers:
        if w.role in ("decode", "colocated"):
            total += min(per_worker, w.load.num_blocks) if w.load.num_blocks > 0 else per_worker
    return total


def choose_embedder(workers: Sequence[WorkerSnapshot], inputs: Sequence[Sequence[int]]
                    ) -> WorkerSnapshot | None:
    """Where an embedding request runs: the prefill worker with the least prefill ahead of it
    (embeddings are compute-bound prompt passes that stall no decode batch there), else, with
    no live prefill worker, the decode-capable worker choose_decode picks. No prefix overlap:
    pooling reads no cached block."""
    tokens = sum(map(len, inputs))
    prefill = [w for w in workers if w.role == "prefill"]
    if prefill:
        return min(prefill, key=lambda w: (prefill_cost(w, tokens, 0), w.worker_id))
    chosen = choose_decode(workers, Prompt(inputs[0]))
    return None if chosen is None else chosen[0]
