"""Per-request block tables over one `BlockPool`.

A request's block table lists the blocks that hold its tokens' keys and values, in
position order. It grows one block at a time as the request's tokens are computed, and
is freed in one go when the request finishes or is preempted.

    block_size = 4, block_table = [7, 2, 5]

    position   0  1  2  3 |  4  5  6  7 |  8  9 10 11
    block      7          |  2          |  5
    slot      28 29 30 31 |  8  9 10 11 | 20 21 22 23

    slot = block_table[pos // block_size] * block_size + pos % block_size

A slot is the row of the flat KV tensor ``[num_blocks * block_size, ...]`` that the runner
writes position `pos` into.
"""

from kvcache.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        assert block_size > 0, f"block_size must be > 0, got {block_size}"
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty for an unknown id)."""
        return list(self.block_tables.get(request_id, ()))

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """New blocks needed so the table covers positions ``0..num_total_tokens-1``."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the table to cover `num_total_tokens` positions. All or nothing: returns
        False and changes nothing when there are not enough free blocks."""
        n = self.num_blocks_needed(request_id, num_total_tokens)
        if n > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if n:
            table.extend(self.pool.allocate(n))
        return True

    def free(self, request_id: str) -> None:
        """Release the request's blocks; a no-op for an unknown (or already freed) id."""
        table = self.block_tables.pop(request_id, None)
        if table:
            # Tail first: with prefix caching the tail is the least shareable, so it should
            # be the first evicted (the free list is FIFO).
            self.pool.free(reversed(table))

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots of positions ``start..end-1`` (see the module docstring)."""
        table = self.block_tables.get(request_id, [])
        bs = self.block_size
        assert 0 <= start <= end <= len(table) * bs, (
            f"{request_id}: positions [{start}, {end}) outside {len(table)} blocks of {bs}"
        )
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def check_integrity(self) -> None:
        """Prove no block is leaked or double-owned. Raises AssertionError on violation."""
        pool = self.pool
        owners = [0] * pool.num_blocks
        for rid, table in self.block_tables.items():
            for b in table:
                assert 0 <= b < pool.num_blocks, f"{rid}: block id {b} out of range"
                owners[b] += 1
        free = set(pool.free_blocks)
        assert len(free) == len(pool.free_blocks), "free list has duplicates"
        for b in range(pool.num_blocks):
            refs = pool.ref_counts[b]
            assert refs == owners[b], f"block {b}: ref count {refs} != {owners[b]} owners"
            assert not (b in free and owners[b]), f"block {b} is both free and owned"
            assert b in free or owners[b], f"block {b} is neither free nor owned (leaked)"
