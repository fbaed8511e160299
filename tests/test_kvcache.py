"""Block pool, block tables, slot mapping, integrity checks and budget arithmetic."""

import pytest

from kvcache import BlockPool, KVBudget, KVCacheManager, kv_bytes_per_token, num_blocks_for_budget

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
    kv.pool.free_blocks.append(kv.pool.free_blocks[0])


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
