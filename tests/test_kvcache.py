"""Block hashes, block pool (ref counts, cached blocks, lazy LRU eviction), swap space,
block tables, slot mapping, integrity checks and budget arithmetic."""

import hashlib
import struct

import pytest

from kvcache import (
    ROOT,
    BlockPool,
    KVBudget,
    KVCacheManager,
    SwapSpace,
    hash_block,
    iter_block_hashes,
    kv_bytes_per_token,
    num_blocks_for_budget,
)

# -- block hashes -----------------------------------------------------------------------------


def test_hash_encoding_is_stable():
    # Pinned bytes: the same prefix must hash the same in every process and Python version.
    want = hashlib.sha256(bytes(32) + b"\x00" + struct.pack("<4Q", 1, 2, 3, 4)).digest()
    assert hash_block(ROOT, [1, 2, 3, 4]) == want
    assert want.hex().startswith("98cabf44735ff2ef")
    salted = bytes(32) + b"\x01" + (6).to_bytes(4, "little") + b"tenant"
    salted += struct.pack("<4Q", 1, 2, 3, 4)
    assert hash_block(ROOT, [1, 2, 3, 4], "tenant") == hashlib.sha256(salted).digest()


def test_hash_depends_on_salt():
    toks = [5, 6, 7, 8]
    hashes = {hash_block(ROOT, toks, s) for s in (None, "", "a", "b", "ab")}
    assert len(hashes) == 5  # None and "" differ too


def test_hash_depends_on_the_whole_chain():
    a = list(iter_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4))
    b = list(iter_block_hashes([0, 2, 3, 4, 9, 9, 9, 9], 4))
    assert a[0] != b[0] and a[1] != b[1]  # same second block, other parent
    assert a[1] == hash_block(a[0], [9, 9, 9, 9])
    assert a[0] != hash_block(ROOT, [2, 3, 4, 9])  # no confusion across boundaries


def test_only_full_blocks_are_hashed_and_lazily():
    toks = list(range(10))
    assert len(list(iter_block_hashes(toks, 4))) == 2
    assert list(iter_block_hashes(toks[:3], 4)) == []
    full = list(iter_block_hashes(toks, 4))
    assert list(iter_block_hashes(toks, 4, parent=full[0], start_block=1)) == full[1:]
    it = iter_block_hashes(list(range(4000)), 4)
    assert next(it) == hash_block(ROOT, [0, 1, 2, 3])  # no need to hash the rest


# -- BlockPool --------------------------------------------------------------------------------


def test_pool_allocate_free_fifo_reuse():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.allocate(2)
    assert a == [0, 1] and pool.num_free_blocks == 2 and pool.usage == 0.5
    pool.free([1, 0])
    # FIFO: blocks never used come before the ones just freed, in freeing order.
    assert pool.allocate(4) == [2, 3, 1, 0]
    assert pool.usage == 1.0


def test_pool_allocate_too_many_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="need 3 blocks"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_pool_refcounts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_counts[b] == 2
    pool.free([b])
    assert pool.num_free_blocks == 1  # still referenced once
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])
    with pytest.raises(AssertionError, match="incref of free"):
        pool.incref([b])


def _cached_pool(n: int = 6) -> tuple[BlockPool, list[int]]:
    """A pool whose first 3 blocks hold a cached chain, freed tail first like a request."""
    pool = BlockPool(n)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        assert pool.cache(b, bytes([i]) * 32)
    pool.free(reversed(blocks))
    return pool, blocks


def test_freed_cached_blocks_stay_findable_until_evicted():
    pool, blocks = _cached_pool()
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    assert [pool.lookup(bytes([i]) * 32) for i in range(3)] == blocks
    pool.check_integrity()


def test_uncached_blocks_are_handed_out_before_cached_ones():
    pool, _ = _cached_pool()
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_cached_blocks == 3  # nothing evicted yet


def test_eviction_is_lru_and_takes_chain_tails_first():
    pool, blocks = _cached_pool()
    pool.allocate(3)
    (b,) = pool.allocate(1)
    assert b == blocks[2]  # the tail, freed first
    assert pool.lookup(bytes([2]) * 32) is None and pool.block_hashes[b] is None
    assert pool.lookup(bytes([0]) * 32) == blocks[0]  # the head still hits
    assert pool.allocate(2) == [blocks[1], blocks[0]]
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_touch_revives_a_free_cached_block_and_refreshes_its_lru_place():
    pool, blocks = _cached_pool()
    pool.touch([blocks[2]])  # a hit on the tail: in use again, not evictable
    assert pool.ref_counts[blocks[2]] == 1 and pool.num_free_blocks == 5
    pool.free([blocks[2]])  # now the most recently used
    pool.allocate(3)
    assert pool.allocate(3) == [blocks[1], blocks[0], blocks[2]]
    with pytest.raises(AssertionError, match="uncached"):
        pool.touch([0])


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h" * 32)
    assert not pool.cache(b, b"h" * 32)
    assert pool.lookup(b"h" * 32) == a and pool.block_hashes[b] is None
    pool.free([b])
    assert list(pool.free_uncached)[-1] == b  # a duplicate frees as a plain block
    pool.check_integrity()


def test_drop_all_hashes():
    pool, blocks = _cached_pool()
    assert pool.drop_all_hashes() == 3
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 6
    assert pool.free_blocks == [3, 4, 5, blocks[2], blocks[1], blocks[0]]
    pool.check_integrity()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda p: p.block_hashes.__setitem__(3, b"x" * 32), "free block 3 has a hash"),
        (lambda p: p.cached.__setitem__(b"y" * 32, 0), "registry and block hash disagree"),
        (lambda p: p.free_cached.popitem(), "leaked"),
    ],
)
def test_integrity_catches_registry_corruption(corrupt, message):
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.pool, _ = _cached_pool()
    kv.check_integrity()
    corrupt(kv.pool)
    with pytest.raises(AssertionError, match=message):
        kv.check_integrity()


# -- SwapSpace --------------------------------------------------------------------------------


def test_swap_space_never_over_commits_and_parks_swapped_in_blocks():
    cpu = SwapSpace(3)
    a = cpu.allocate(2)
    with pytest.raises(RuntimeError, match="need 2 CPU blocks"):
        cpu.allocate(2)
    cpu.free_after_step(a)  # read by this step's swap-in: not reusable yet
    assert cpu.num_free_blocks == 1
    cpu.check_integrity([])
    cpu.step_done()
    assert cpu.num_free_blocks == 3
    with pytest.raises(AssertionError, match="twice"):
        cpu.check_integrity([a[0]])
    cpu.free_blocks.pop()
    with pytest.raises(AssertionError, match="leaked"):
        cpu.check_integrity([])


# -- KVCacheManager ---------------------------------------------------------------------------


def test_tables_grow_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert kv.num_blocks_needed("a", 1) == 1
    assert kv.allocate_slots("a", 1) and len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", 16) and len(kv.block_table("a")) == 1
    assert kv.num_blocks_needed("a", 17) == 1
    assert kv.allocate_slots("a", 17) and len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 10) and len(kv.block_table("a")) == 2  # never shrinks
    assert kv.num_blocks_needed("a", 64) == 2
    assert kv.allocate_slots("a", 64) and len(kv.block_table("a")) == 4
    assert kv.blocks_in_use() == 4 and kv.num_free_blocks == 4 and kv.usage == 0.5
    kv.check_integrity()


def test_allocate_slots_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 12)  # 3 blocks
    before = kv.block_table("a")
    assert not kv.allocate_slots("b", 8)  # needs 2, 1 free
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert not kv.allocate_slots("a", 20)  # needs 2 more
    assert kv.block_table("a") == before and kv.num_free_blocks == 1
    assert kv.allocate_slots("b", 4)
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_block_table_is_a_copy():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 4)
    kv.block_table("a").append(99)
    assert kv.block_table("a") == [0]


def test_slot_mapping():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("x", 4)  # block 0, so "a" gets non-trivial ids
    kv.allocate_slots("a", 10)  # blocks 1, 2, 3
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.slot_mapping("a", 0, 10) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert kv.slot_mapping("a", 6, 9) == [10, 11, 12]
    assert kv.slot_mapping("a", 5, 5) == []
    kv.free("x")
    kv.allocate_slots("a", 13)  # reuses block 4 (never used) before freed block 0
    assert kv.block_table("a") == [1, 2, 3, 4]
    assert kv.slot_mapping("a", 11, 13) == [15, 16]
    with pytest.raises(AssertionError, match="outside"):
        kv.slot_mapping("a", 0, 17)


def test_free_is_idempotent():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 9)
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.block_table("a") == []
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def _corrupt_dup_free(kv: KVCacheManager) -> None:
    kv.pool.free_uncached.append(kv.pool.free_uncached[0])


def _corrupt_refcount(kv: KVCacheManager) -> None:
    kv.pool.ref_counts[kv.block_tables["a"][0]] += 1


def _corrupt_free_and_owned(kv: KVCacheManager) -> None:
    kv.block_tables["b"] = [kv.pool.free_blocks[0]]
    kv.pool.ref_counts[kv.pool.free_blocks[0]] = 1


def _corrupt_leak(kv: KVCacheManager) -> None:
    del kv.block_tables["a"]  # blocks neither free nor owned, refs left behind


def _corrupt_leak_zero_refs(kv: KVCacheManager) -> None:
    b = kv.block_tables["a"].pop()
    kv.pool.ref_counts[b] = 0


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_dup_free, "duplicates"),
        (_corrupt_refcount, "ref count"),
        (_corrupt_free_and_owned, "both free and owned"),
        (_corrupt_leak, "ref count"),
        (_corrupt_leak_zero_refs, "leaked"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate_slots("a", 9)
    kv.check_integrity()
    corrupt(kv)
    with pytest.raises(AssertionError, match=message):
        kv.check_integrity()


# -- budget -----------------------------------------------------------------------------------


def test_kv_bytes_per_token_smollm2_135m():
    # 30 layers, 3 KV heads, head_dim 64, fp32: K and V.
    assert kv_bytes_per_token(30, 3, 64, 4) == 46080
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040


def test_num_blocks_for_budget_rounds_down():
    assert num_blocks_for_budget(46080 * 16 * 10, 16, 46080) == 10
    assert num_blocks_for_budget(46080 * 16 * 10 - 1, 16, 46080) == 9
    assert num_blocks_for_budget(0, 16, 46080) == 0


def test_kv_budget_describe():
    bpt = 32768  # e.g. 16 layers x 8 KV heads x 64 dims x fp16 x (K, V)
    assert kv_bytes_per_token(16, 8, 64, 2) == bpt
    b = KVBudget.from_budget(2 << 30, block_size=16, bytes_per_token=bpt, max_model_len=8192)
    assert b.num_blocks == 4096 and b.num_tokens == 65536
    assert b.max_concurrent_requests == 8
    assert b.describe() == (
        "KV cache: 2.00 GiB = 4096 blocks x 16 tokens = 65536 tokens; "
        "8 requests of 8192 tokens at once"
    )


def test_kv_budget_max_concurrent_rounds_up_to_blocks():
    # 100 tokens need 7 blocks of 16 (112 tokens): 20 blocks hold 2 such requests, not 3.
    b = KVBudget(budget_bytes=0, block_size=16, bytes_per_token=1, num_blocks=20, max_model_len=100)
    assert b.num_tokens == 320 and b.max_concurrent_requests == 2


def test_kv_budget_is_frozen():
    b = KVBudget(1, 16, 1, 0, 10)
    with pytest.raises(AttributeError):
        b.num_blocks = 3  # type: ignore[misc]
