"""A pool of fixed-size KV blocks with reference counts.

A block is an int id in ``0..num_blocks-1``; the runner owns the tensors, the pool
only says which ids are taken. A block is free exactly when its reference count is 0.
"""

from collections import deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, f"num_blocks must be > 0, got {num_blocks}"
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        # FIFO reuse: a freed block goes to the back, so the block freed longest ago is
        # handed out first. Prefix caching relies on this order for lazy LRU eviction.
        self.free_blocks: deque[int] = deque(range(num_blocks))
        # Prefix caching (a later issue) lives here: `cached: dict[hash, block]` and the
        # reverse map. A freed block keeps its hash and stays findable until `allocate`
        # pops it off the free list, which is when its hash is evicted (lazy LRU).

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each). Callers check `num_free_blocks` first."""
        if n > len(self.free_blocks):
            raise RuntimeError(f"need {n} blocks, only {len(self.free_blocks)} free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            assert self.ref_counts[b] == 0, f"block {b} on the free list has refs"
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks already in use (prefix sharing, copy-on-write)."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block at 0 refs returns to the free list."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
