import random

import pytest

from engine.block_manager import Allocation, BlockManager


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_extend_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_used_blocks) == (8, 4, 8, 0)
    prompt = tokens(6)
    a = bm.allocate("r1", prompt, 6)
    assert isinstance(a, Allocation)
    assert len(a.block_ids) == 2 and a.new_block_ids == a.block_ids and a.num_cached_tokens == 0
    assert bm.num_used_blocks == 2 and bm.usage == 0.25 and bm.has("r1")
    # Growing within the last block takes nothing; crossing a boundary takes one block.
    same = bm.allocate("r1", prompt, 8)
    assert same.block_ids == a.block_ids and same.new_block_ids == []
    grown = bm.allocate("r1", prompt, 9)
    assert grown.block_ids[:2] == a.block_ids and len(grown.new_block_ids) == 1
    assert grown.block_ids == bm.block_table("r1") and grown.num_cached_tokens == 0
    assert bm.blocks_needed("r1", 9) == 0 and bm.blocks_needed("r1", 13) == 1
    assert bm.blocks_needed("new", 9) == 3
    bm.check_invariants()
    bm.free("r1")
    assert not bm.has("r1") and bm.owners() == [] and bm.num_free_blocks == 8
    bm.free("r1")  # a second free (finish after abort) is a no-op
    bm.free("never-seen")
    bm.check_invariants()


def test_block_table_is_a_copy():
    bm = BlockManager(4, 4)
    bm.allocate("r", tokens(4), 4)
    bm.block_table("r").append(99)
    assert len(bm.block_table("r")) == 1
    with pytest.raises(KeyError):
        bm.block_table("nobody")


def test_pool_returns_to_full_after_every_owner_freed():
    bm = BlockManager(16, 4)
    for i in range(5):
        assert bm.allocate(f"r{i}", tokens(7, 100 * i), 7) is not None
        bm.commit(f"r{i}", tokens(7, 100 * i), 7)
    assert bm.num_free_blocks == 6 and sorted(bm.owners()) == [f"r{i}" for i in range(5)]
    for i in range(5):
        bm.free(f"r{i}")
        bm.check_invariants()
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0 and bm.usage == 0.0


def test_prefix_hit_shares_blocks_with_refcounts():
    bm = BlockManager(16, 4)
    prompt = tokens(10)
    a = bm.allocate("a", prompt, 10)
    bm.commit("a", prompt, 10)  # blocks 0 and 1 are full and registered; block 2 is partial
    b = bm.allocate("b", prompt[:8] + [500, 501, 502], 11)
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert b.new_block_ids == b.block_ids[2:]
    assert bm.num_used_blocks == 4
    bm.check_invariants()
    # The shared blocks survive one owner's free...
    bm.free("a")
    assert bm.num_used_blocks == 3 and bm.block_table("b")[:2] == a.block_ids[:2]
    bm.check_invariants()
    # ...and after both, stay reusable: a third owner with the same prefix hits them.
    bm.free("b")
    assert bm.num_free_blocks == 16
    c = bm.allocate("c", prompt, 10)
    assert c.num_cached_tokens == 8 and c.block_ids[:2] == a.block_ids[:2]
    assert bm.cached_prefix_len(prompt) == 8
    bm.check_invariants()


def test_hit_requires_the_whole_prefix_to_match():
    bm = BlockManager(16, 4)
    prompt = tokens(12)
    bm.allocate("a", prompt, 12)
    bm.commit("a", prompt, 12)
    # Same second block, different first block: chained hashes differ, no hit at all.
    other = [99, 98, 97, 96] + prompt[4:] + [7]
    assert bm.allocate("b", other, len(other)).num_cached_tokens == 0
    # Diverging in the second block: only the first block is shared.
    diverge = prompt[:4] + [0, 0, 0, 0] + prompt[8:] + [7]
    assert bm.allocate("c", diverge, len(diverge)).num_cached_tokens == 4
    bm.check_invariants()


def test_cap_keeps_the_last_token_computed():
    bm = BlockManager(16, 4)
    prompt = tokens(8)  # exactly two full blocks
    bm.allocate("a", prompt, 8)
    bm.commit("a", prompt, 8)
    b = bm.allocate("b", prompt, 8)
    assert b.num_cached_tokens == 4  # only the first block: token 7 must be recomputed
    assert len(b.block_ids) == 2 and len(b.new_block_ids) == 1
    assert bm.cached_prefix_len(prompt) == 4
    assert bm.allocate("c", prompt + [8], 9).num_cached_tokens == 8
    assert bm.allocate("d", [], 0).num_cached_tokens == 0
    bm.check_invariants()


def test_only_the_first_call_looks_up_the_cache():
    bm = BlockManager(16, 4)
    prompt = tokens(9)
    bm.allocate("a", prompt, 9)
    bm.commit("a", prompt, 9)
    b = bm.allocate("b", tokens(3, 50), 3)  # no hit
    later = bm.allocate("b", prompt, 9)
    assert later.num_cached_tokens == 0 and bm.block_table("b")[0] not in bm.block_table("a")


def test_hit_larger_than_num_tokens_is_kept():
    # A chunked prefill may ask for a first chunk shorter than the cached prefix; the table
    # then covers the whole hit and the chunk starts after it.
    bm = BlockManager(16, 4)
    prompt = tokens(17)
    bm.allocate("a", prompt, 17)
    bm.commit("a", prompt, 17)
    b = bm.allocate("b", prompt, 4)
    assert b.num_cached_tokens == 16 and len(b.block_ids) == 4 and b.new_block_ids == []
    bm.check_invariants()


def test_atomic_failure_when_pool_exhausted():
    bm = BlockManager(6, 4)
    prompt = tokens(12)
    bm.allocate("a", prompt, 12)
    bm.commit("a", prompt, 12)
    bm.free("a")  # 3 cached free blocks, 3 plain free blocks
    bm.allocate("x", tokens(8, 200), 8)  # takes the 2 plain ones first... and one more
    bm.allocate("y", tokens(4, 300), 4)
    assert bm.num_free_blocks == 3
    state = (bm.num_free_blocks, bm.owners(), bm.cached_prefix_len(prompt + [1]))
    # A hit of 3 blocks plus 2 fresh ones needs 5 of the 3 free blocks (the hit blocks are
    # themselves free): refused, and the hit's references are not kept.
    assert bm.allocate("b", prompt + [1], 20) is None
    assert (bm.num_free_blocks, bm.owners(), bm.cached_prefix_len(prompt + [1])) == state
    assert not bm.has("b")
    bm.check_invariants()
    # Extending an existing owner beyond the pool fails the same way.
    table = bm.block_table("x")
    assert bm.allocate("x", [], 4 * 10) is None
    assert bm.block_table("x") == table and bm.num_free_blocks == 3
    # With one plain block freed, the hit (3 cached blocks) plus 1 fresh block fits exactly.
    assert bm.allocate("b", prompt + [1], 13) is None
    bm.free("y")
    b = bm.allocate("b", prompt + [1], 13)
    assert b is not None and b.num_cached_tokens == 12 and len(b.new_block_ids) == 1
    assert bm.num_free_blocks == 0 and not bm.can_allocate(1) and bm.can_allocate(0)
    bm.check_invariants()


def test_free_blocks_include_cached_ones_and_eviction_order():
    bm = BlockManager(4, 2)
    old, new = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    bm.allocate("old", old, 5)  # 3 blocks: two full + one partial
    bm.commit("old", old, 5)
    bm.free("old")
    assert bm.num_free_blocks == 4 and bm.cached_prefix_len(old) == 4
    # One plain block is free (the never-used one) plus old's partial block; both go before
    # any cached block.
    bm.allocate("x", [0, 0, 0, 0], 4)
    assert bm.cached_prefix_len(old) == 4
    bm.free("x")
    bm.allocate("new", new, 5)  # 3 blocks: the 2 plain ones, then evicts one cached block
    bm.commit("new", new, 5)
    # old's tail block was freed before its head (freed tail-first), so the tail went first
    # and the head still hits.
    assert bm.cached_prefix_len(old) == 2
    bm.free("new")
    # new's partial block went to the plain list and is taken first...
    bm.allocate("y", [42, 42], 2)
    assert bm.cached_prefix_len(old) == 2 and bm.cached_prefix_len(new) == 4
    # ...then LRU among cached: old's head is the least recently freed, new's blocks are newer.
    bm.allocate("z", [43, 43], 2)
    assert bm.cached_prefix_len(old) == 0 and bm.cached_prefix_len(new) == 4
    bm.check_invariants()


def test_reallocated_block_loses_its_cache_entry():
    bm = BlockManager(2, 2)
    bm.allocate("a", [1, 2, 3], 3)
    bm.commit("a", [1, 2, 3], 3)
    bm.free("a")
    assert bm.cached_prefix_len([1, 2, 3]) == 2
    bm.allocate("b", [7, 8, 9, 10], 4)  # needs both blocks: evicts the cached one
    assert bm.cached_prefix_len([1, 2, 3]) == 0
    bm.check_invariants()


def test_commit_is_idempotent_and_incremental():
    bm = BlockManager(16, 4)
    seq = tokens(6)
    bm.allocate("a", seq, 6)
    bm.commit("a", seq, 6)
    bm.commit("a", seq, 6)
    bm.commit("a", seq, 3)  # going backwards changes nothing
    assert bm.cached_prefix_len(seq + [0]) == 4
    # Decode grows the sequence; committing more registers only the newly full block.
    seq += [6, 7, 8]
    bm.allocate("a", seq, 9)
    bm.commit("a", seq, 9)
    bm.commit("a", seq, 9)
    assert bm.cached_prefix_len(seq) == 8
    bm.check_invariants()
    # commit never registers past what the table holds, nor partial blocks.
    bm.commit("a", seq + tokens(20, 50), 29)
    assert bm.cached_prefix_len(seq + tokens(20, 50)) == 12
    bm.check_invariants()
    with pytest.raises(KeyError):
        bm.commit("ghost", seq, 4)


def test_duplicate_prefix_computed_twice_keeps_one_registration():
    bm = BlockManager(16, 4)
    prompt = tokens(9)
    a = bm.allocate("a", prompt, 9)
    b = bm.allocate("b", prompt, 9)  # nothing cached yet: both compute the prefix
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    bm.commit("a", prompt, 9)
    bm.commit("b", prompt, 9)
    bm.check_invariants()
    c = bm.allocate("c", prompt, 9)
    assert c.block_ids[:2] == a.block_ids[:2]
    for owner in ("a", "b", "c"):
        bm.free(owner)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    prompt = tokens(9)
    bm.allocate("a", prompt, 9)
    bm.commit("a", prompt, 9)
    assert bm.allocate("b", prompt, 9).num_cached_tokens == 0
    assert bm.cached_prefix_len(prompt) == 0
    bm.check_invariants()


def test_reset_prefix_cache():
    bm = BlockManager(8, 4)
    prompt = tokens(9)
    bm.allocate("a", prompt, 9)
    bm.commit("a", prompt, 9)
    bm.allocate("b", tokens(9, 100), 9)
    bm.commit("b", tokens(9, 100), 9)
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.cached_prefix_len(prompt) == 0 and bm.cached_prefix_len(tokens(9, 100)) == 0
    assert bm.num_free_blocks == 5 and len(bm.block_table("a")) == 3
    bm.check_invariants()


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_check_invariants_detects_corruption():
    bm = BlockManager(4, 2)
    bm.allocate("a", [1, 2, 3], 3)
    bm._refcount[bm.block_table("a")[0]] += 1  # simulate a leaked reference
    with pytest.raises(AssertionError, match="refcounts"):
        bm.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    bm = BlockManager(num_blocks=rng.randint(4, 24), block_size=block_size)
    # Few distinct prefixes, so that hits, sharing and eviction all happen.
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    live: dict[str, tuple[list[int], int]] = {}  # owner -> (tokens, slots allocated)
    hits = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not live:
            owner = f"o{step}"
            seq = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            before = bm.num_free_blocks
            alloc = bm.allocate(owner, seq, rng.randint(0, len(seq)))
            if alloc is None:
                assert bm.num_free_blocks == before and not bm.has(owner)
            else:
                hits += alloc.num_cached_tokens > 0
                assert alloc.num_cached_tokens <= max(0, len(seq) - 1)
                assert alloc.num_cached_tokens % block_size == 0
                live[owner] = (seq, max(len(alloc.block_ids) * block_size, 0))
        elif op < 0.7:
            owner = rng.choice(sorted(live))
            seq, _ = live[owner]
            seq = seq + [rng.randrange(5) for _ in range(rng.randint(1, 5))]
            table = bm.block_table(owner)
            alloc = bm.allocate(owner, seq, len(seq))
            if alloc is None:
                assert bm.block_table(owner) == table
            else:
                assert alloc.block_ids[:len(table)] == table and alloc.num_cached_tokens == 0
                live[owner] = (seq, len(alloc.block_ids) * block_size)
        elif op < 0.85:
            owner = rng.choice(sorted(live))
            seq, slots = live[owner]
            bm.commit(owner, seq, min(len(seq), slots))
        else:
            owner = rng.choice(sorted(live))
            bm.free(owner)
            del live[owner]
        bm.check_invariants()
        assert sorted(bm.owners()) == sorted(live)
        assert bm.num_used_blocks == len({b for o in live for b in bm.block_table(o)})
    assert hits > 0
    for owner in list(live):
        bm.free(owner)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_tenants_share_blocks_only_within_their_salt():
    """A prompt cached by one tenant is a miss for another (no cached_tokens side channel),
    a hit for the same tenant, and the hashes the coordinator computes match the registry."""
    from common.block_hash import block_hashes

    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    bm.allocate("a1", prompt, len(prompt), salt=b"tenant-a")
    bm.commit("a1", prompt, len(prompt))
    assert sorted(bm.cached_hashes()) == sorted(block_hashes(prompt, 4, b"tenant-a"))
    assert set(bm.cached_hashes()).isdisjoint(block_hashes(prompt, 4))
    other = bm.allocate("b1", prompt, len(prompt), salt=b"tenant-b")
    shared = bm.allocate("s1", prompt, len(prompt))  # the unsalted (shared) cache
    same = bm.allocate("a2", prompt, len(prompt), salt=b"tenant-a")
    assert other.num_cached_tokens == 0 and shared.num_cached_tokens == 0
    assert same.num_cached_tokens == 12 and same.block_ids[:3] == bm.block_table("a1")[:3]
    assert bm.cached_prefix_len(prompt, b"tenant-a") == 12
    assert bm.cached_prefix_len(prompt, b"tenant-b") == 0 == bm.cached_prefix_len(prompt)
    bm.commit("b1", prompt, len(prompt))  # b's own copy registers under b's salt
    assert bm.allocate("b2", prompt, len(prompt), salt=b"tenant-b").num_cached_tokens == 12
    bm.check_invariants()
    for owner in ("a1", "b1", "s1", "a2", "b2"):
        bm.free(owner)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_trim_frees_the_tail_but_never_committed_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = tokens(9)
    bm.allocate("r1", prompt, 9)
    bm.commit("r1", prompt, 8)  # two full blocks registered
    grown = bm.allocate("r1", prompt, 20)  # room for a speculative step's drafts
    assert len(grown.block_ids) == 5
    freed = bm.trim("r1", 10)  # only 10 slots needed after verification
    assert freed == grown.block_ids[3:] and bm.block_table("r1") == grown.block_ids[:3]
    assert bm.num_free_blocks == 5
    assert bm.trim("r1", 1) == [grown.block_ids[2]]  # the two committed blocks stay
    assert bm.block_table("r1") == grown.block_ids[:2]
    bm.check_invariants()
    bm.free("r1")
    assert bm.num_free_blocks == 8
    bm.check_invariants()
    with pytest.raises(KeyError):
        bm.trim("gone", 4)
