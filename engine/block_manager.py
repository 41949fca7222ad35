"""Bookkeeping for the paged KV pool, with prefix caching. Torch-free.

A block holds `block_size` token slots for every layer; a request's block table is a list of
block ids, the same ids in every layer, so token t of a request lives in slot
`table[t // block_size] * block_size + t % block_size`.

Ownership. Each block has a refcount: the number of owner tables that hold it. An owner is any
string id: a request, or a reservation that a remote prefill worker writes into (that is just an
owner too; it is freed like any other). Only `free(owner)` drops references, so whoever ends a
request (finish, abort, disconnect, failed transfer) calls `free` once; a second call is a
no-op, which lets several of those paths free without coordinating.

Prefix caching. A full block whose KV has been written (`commit`) is registered under a chained
hash: hash(parent block's hash, this block's token ids). Equal hashes therefore mean equal
whole prefixes, not just equal blocks. An owner's first `allocate` reuses the longest run of
registered blocks matching its tokens (refcount + 1, no copy). A block whose refcount drops to 0
stays registered and reusable until a fresh allocation takes it for other tokens.

Free list, in eviction order (what a fresh allocation takes first):

    [ unregistered free blocks, FIFO ] then [ registered free blocks, least recently freed ]

Both kinds count as free (`num_free_blocks`): a cached prefix never blocks an allocation.

Not thread-safe: one engine loop owns it. A registered block's contents are immutable (its
tokens are fixed by its hash), so sharing it is safe; only the last, partial block of a table is
ever written after commit, and a partial block is never registered or shared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from common.block_hash import chain_hash, root_hash


@dataclass(frozen=True)
class Allocation:
    block_ids: list[int]  # the owner's whole block table after the call
    num_cached_tokens: int  # tokens reused from the prefix cache by this call (0 after the first)
    new_block_ids: list[int]  # blocks this call added that hold no KV yet (to be written)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, "
                             f"got {num_blocks} and {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._caching = enable_prefix_caching
        self._refcount = [0] * num_blocks
        # Free blocks (refcount 0), split so that eviction takes unregistered ones first.
        self._free_plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest freed first
        # The prefix cache: registered blocks, both directions. In use or free.
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self._tables: dict[str, list[int]] = {}
        # Chain hashes of each owner's leading full blocks whose KV is committed: commit's
        # progress, so a second commit of the same tokens does no work.
        self._hashes: dict[str, list[bytes]] = {}
        # Each owner's chain root (common/block_hash.py root_hash of its tenant's salt).
        self._roots: dict[str, bytes] = {}
        # Bumped whenever the set of registered hashes changes, so a publisher (heartbeats
        # for prefix-aware routing) copies cached_hashes() only when there is news.
        self.cache_version = 0

    # ---- sizes ----

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    # ---- queries ----

    def has(self, owner: str) -> bool:
        return owner in self._tables

    def owners(self) -> list[str]:
        return list(self._tables)

    def block_table(self, owner: str) -> list[int]:
        """A copy of the owner's table. KeyError for an unknown owner."""
        return list(self._tables[owner])

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free_blocks

    def blocks_needed(self, owner: str, num_tokens: int) -> int:
        """Fresh blocks `allocate(owner, ..., num_tokens)` would take. For an owner not yet seen
        this ignores prefix hits, so it is an upper bound."""
        have = len(self._tables.get(owner, ()))
        return max(0, self._blocks_for(num_tokens) - have)

    def cached_hashes(self) -> list[bytes]:
        """Chain hashes of every registered block (in use or free): what the prefix cache can
        serve. See block_hashes() for computing a prompt's."""
        return list(self._hash_to_block)

    def cached_prefix_len(self, token_ids: Sequence[int], salt: bytes = b"") -> int:
        """Tokens of `token_ids` an owner's first `allocate` would reuse now (read-only), so a
        scheduler can size a prefill chunk before allocating."""
        return len(self._lookup(token_ids, root_hash(salt))[0]) * self._block_size

    # ---- allocation ----

    def allocate(self, owner: str, token_ids: Sequence[int], num_tokens: int,
                 use_prefix_cache: bool = True, salt: bytes = b"") -> Allocation | None:
        """Make `owner`'s table cover `num_tokens` slots (and, on the first call, at least the
        cached prefix found for `token_ids`). None, with nothing changed, if the pool is short.

        First call: reuse the longest registered prefix of `token_ids`, capped so that the last
        token is always computed (the model needs its logits). Later calls only append blocks;
        `token_ids` is then unused. use_prefix_cache=False takes only fresh blocks (for blocks
        a remote writer fills: it must never write into blocks other requests share). `salt`
        (first call): the owner's tenant; it reuses and registers only blocks of that salt.
        """
        first = owner not in self._tables
        lookup = first and use_prefix_cache
        root = root_hash(salt) if first else self._roots[owner]
        hit_blocks, hit_hashes = self._lookup(token_ids, root) if lookup else ([], [])
        table = self._tables.get(owner, [])
        covered = max(num_tokens, len(hit_blocks) * self._block_size)
        need = max(0, self._blocks_for(covered) - len(table) - len(hit_blocks))
        # Hit blocks that sit on the free list stop being free once taken: they are not
        # available for the fresh part of this same allocation.
        hits_free = sum(1 for b in hit_blocks if self._refcount[b] == 0)
        if need > self.num_free_blocks - hits_free:
            return None

        for block in hit_blocks:
            self._take(block)
        new_blocks = [self._take_fresh() for _ in range(need)]
        if first:
            table = self._tables[owner] = list(hit_blocks)
            self._hashes[owner] = list(hit_hashes)
            self._roots[owner] = root
        table.extend(new_blocks)
        return Allocation(block_ids=list(table),
                          num_cached_tokens=len(hit_blocks) * self._block_size,
                          new_block_ids=new_blocks)

    def commit(self, owner: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the owner's full blocks among its first `num_computed_tokens` tokens, whose
        KV is now written. Call after each chunk or step; already registered blocks are skipped.
        KeyError for an unknown owner."""
        table = self._tables[owner]
        if not self._caching:
            return
        hashes = self._hashes[owner]
        full = min(num_computed_tokens, len(token_ids)) // self._block_size
        full = min(full, len(table))
        bs = self._block_size
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else self._roots[owner]
            digest = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(digest)
            block = table[i]
            # Another owner may have computed the same prefix concurrently and registered it
            # first; keep that entry and leave this block unregistered (it is freed plainly).
            if digest not in self._hash_to_block and block not in self._block_to_hash:
                self._hash_to_block[digest] = block
                self._block_to_hash[block] = digest
                self.cache_version += 1

    def free(self, owner: str) -> None:
        """Drop the owner's references. Unknown owners are a no-op (see module docstring)."""
        table = self._tables.pop(owner, None)
        self._hashes.pop(owner, None)
        self._roots.pop(owner, None)
        if table is None:
            return
        self._release(table)

    def trim(self, owner: str, num_tokens: int) -> list[int]:
        """Shrink the owner's table to the blocks that `num_tokens` slots need, freeing the
        tail: a speculative step's blocks allocated for draft tokens that were rejected.
        Returns the freed block ids. Committed (registered) blocks are never trimmed: their
        tokens are part of the sequence. KeyError for an unknown owner."""
        table = self._tables[owner]
        keep = max(self._blocks_for(num_tokens), len(self._hashes[owner]))
        freed = table[keep:]
        del table[keep:]
        self._release(freed)
        return freed

    def reset_prefix_cache(self) -> None:
        """Forget every registration (e.g. after new weights are loaded). Blocks in use keep
        their KV and owners; they just can no longer be shared."""
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        self.cache_version += 1
        self._free_plain.update(self._free_cached)
        self._free_cached.clear()

    # ---- checks ----

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. For tests and debugging."""
        counts = [0] * self._num_blocks
        for owner, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"owner {owner!r} holds a block twice: {table}")
            for block in table:
                counts[block] += 1
        if counts != self._refcount:
            bad = [b for b in range(self._num_blocks) if counts[b] != self._refcount[b]]
            raise AssertionError(f"refcounts disagree with tables at blocks {bad}")
        if self._free_plain.keys() & self._free_cached.keys():
            raise AssertionError("a block is on both free lists")
        free = set(self._free_plain) | set(self._free_cached)
        zero = {b for b in range(self._num_blocks) if self._refcount[b] == 0}
        if free != zero:
            raise AssertionError(f"free list {sorted(free ^ zero)} disagrees with refcounts")
        if any(b not in self._block_to_hash for b in self._free_cached):
            raise AssertionError("an unregistered block is on the cached free list")
        if any(b in self._block_to_hash for b in self._free_plain):
            raise AssertionError("a registered block is on the plain free list")
        if {h: b for b, h in self._block_to_hash.items()} != self._hash_to_block:
            raise AssertionError("prefix-cache maps are not inverse")
        if not self._tables.keys() == self._hashes.keys() == self._roots.keys():
            raise AssertionError("owner tables, hash chains and chain roots disagree")

    # ---- internals ----

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _lookup(self, token_ids: Sequence[int], root: bytes) -> tuple[list[int], list[bytes]]:
        """The registered blocks that hold the longest prefix of token_ids under chain root
        `root`, and their hashes. Stops one token short of the end so that the last token is
        always computed."""
        if not self._caching:
            return [], []
        bs = self._block_size
        max_hit = max(0, (len(token_ids) - 1) // bs)
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for i in range(max_hit):
            parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
            block = self._hash_to_block.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks` (a table or its tail)."""
        # Tail first: a table's later blocks then become least recently freed, so they are
        # evicted before the prefix blocks they depend on (a tail is useless without its head).
        for block in reversed(blocks):
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if block in self._block_to_hash:
                    self._free_cached[block] = None
                else:
                    self._free_plain[block] = None

    def _take(self, block: int) -> None:
        """Add a reference to a registered block, pulling it off the free list if idle."""
        if self._refcount[block] == 0:
            del self._free_cached[block]
        self._refcount[block] += 1

    def _take_fresh(self) -> int:
        """Pop a free block for new KV, evicting the least recently freed cached one if no
        unregistered block is left. The caller has checked that one is free."""
        if self._free_plain:
            block, _ = self._free_plain.popitem(last=False)
        else:
            block, _ = self._free_cached.popitem(last=False)
            del self._hash_to_block[self._block_to_hash.pop(block)]
            self.cache_version += 1
        self._refcount[block] = 1
        return block
