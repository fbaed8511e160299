"""A pool of fixed-size KV blocks with reference counts and a prefix-cache registry.

A block is an int id in ``0..num_blocks-1``; the runner owns the tensors, the pool only
says which ids are taken. A block is free exactly when its reference count is 0.

A full block may carry a content hash (`kvcache.block_hash`), registered in `cached`. A
freed block keeps its hash and its contents, so a later request with the same prefix can
take it back (`touch`) until an allocation needs the space: eviction is lazy. The free
blocks sit in two queues, and `allocate` draws from them in this order:

    free_uncached  FIFO (freed longest ago first)   no hash: nothing to lose by reusing it
    free_cached    LRU  (freed longest ago first)   evicting drops the hash from `cached`

A request frees its block table tail first, so within a request the tail is the older
entry and is evicted before the head: a chain is cut from its end, and its surviving head
still hits.

With `record_events()`, the registry's changes are also recorded as `kvcache.events`
(for a router's prefix index), in order, until `take_events()` takes them: the pool
records evictions and a full clear, the manager (which knows the tokens) newly registered
blocks.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable

from kvcache.block_hash import BlockHash
from kvcache.events import AllCleared, BlocksRemoved, KVEvent


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, f"num_blocks must be > 0, got {num_blocks}"
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> the one block registered under it
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # front = evicted first
        self.events: list[KVEvent] | None = None  # None: not recorded (nobody takes them)

    def record_events(self) -> None:
        """Record registry changes from now on; someone must `take_events()` regularly."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events, ([] if self.events is not None else None)
        return events or []

    def add_event(self, event: KVEvent) -> None:
        if self.events is not None:
            self.events.append(event)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take, cached ones (evictable) included."""
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def free_blocks(self) -> list[int]:
        """Every free block, in the order `allocate` hands them out."""
        return [*self.free_uncached, *self.free_cached]

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), evicting cached ones only when no
        uncached block is left. Callers check `num_free_blocks` first."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"need {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self.free_uncached:
                b = self.free_uncached.popleft()
            else:
                b, _ = self.free_cached.popitem(last=False)
                self._evict(b)
            assert self.ref_counts[b] == 0, f"block {b} on the free list has refs"
            assert self.block_hashes[b] is None, f"block {b} handed out with a hash"
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks already in use."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference to cached blocks found by hash, free (evictable) or in use."""
        for b in blocks:
            assert self.block_hashes[b] is not None, f"touch of uncached block {b}"
            if self.ref_counts[b] == 0:
                del self.free_cached[b]  # no longer evictable
            self.ref_counts[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block at 0 refs joins the back of its
        free queue (the most recently used end)."""
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is None:
                    self.free_uncached.append(b)
                else:
                    self.free_cached[b] = None

    # -- the prefix-cache registry ---------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash. A hash already registered keeps
        its block (two requests computed the same prefix at once): this one stays uncached
        and returns False."""
        assert self.ref_counts[block] > 0, f"caching free block {block}"
        assert self.block_hashes[block] is None, f"block {block} is cached already"
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        self.block_hashes[block] = block_hash
        return True

    def drop_all_hashes(self) -> int:
        """Forget every hash; all cached blocks must be free. Returns how many were dropped.
        They move to the uncached queue in their eviction order."""
        assert all(self.ref_counts[b] == 0 for b in self.cached.values()), "cached block held"
        dropped = len(self.cached)
        for b in self.free_cached:
            self.block_hashes[b] = None
            self.free_uncached.append(b)
        self.free_cached.clear()
        self.cached.clear()
        self.add_event(AllCleared())
        return dropped

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        assert block_hash is not None and self.cached[block_hash] == block
        del self.cached[block_hash]
        self.block_hashes[block] = None
        self.add_event(BlocksRemoved((block_hash,)))

    def check_integrity(self) -> None:
        """Free queues, ref counts and the registry agree. Raises AssertionError."""
        free = [*self.free_uncached, *self.free_cached]
        assert len(set(free)) == len(free), "free list has duplicates"
        for b in free:
            assert self.ref_counts[b] == 0, f"block {b} is both free and owned"
        for b in self.free_uncached:
            assert self.block_hashes[b] is None, f"free block {b} has a hash, queued uncached"
        for b in self.free_cached:
            assert self.block_hashes[b] is not None, f"free block {b} queued cached, no hash"
        for h, b in self.cached.items():
            assert self.block_hashes[b] == h, f"block {b}: registry and block hash disagree"
        num_hashed = sum(h is not None for h in self.block_hashes)
        assert num_hashed == len(self.cached), "a block has a hash outside the registry"
