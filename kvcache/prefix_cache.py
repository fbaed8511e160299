"""Prefix-cache lookups: which cached blocks a new request can reuse, and hit counters.

A request always computes at least its last token: the runner needs that position's
logits to sample. So a hit covers at most ``num_tokens - 1`` tokens, and where every token
is cached (the sequence ends exactly at a block boundary) the last block would be shared
AND written at its last slot. That block is copied instead (copy-on-write):

    block_size 4, tokens t0..t7, both blocks cached as [A, B]
    table      [A,            B']          B' = a fresh block, the runner copies B -> B'
    computed   t0 t1 t2 t3 | t4 t5 t6      the forward recomputes t7 into B'

So a shared block is never written; `KVCacheManager.check_writable` asserts it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.block_hash import BlockHash
from kvcache.block_pool import BlockPool


@dataclass(frozen=True)
class PrefixHit:
    blocks: tuple[int, ...] = ()  # shared as they are, positions 0..len*block_size-1
    hashes: tuple[BlockHash, ...] = ()  # of `blocks`
    num_tokens: int = 0  # tokens the request need not compute
    cow_src: int | None = None  # cached block copied (not shared) right after `blocks`
    num_queried_tokens: int = 0  # the request's tokens at lookup, for the hit rate


def find_cached_prefix(
    pool: BlockPool, block_hashes: Sequence[BlockHash], num_tokens: int, block_size: int
) -> PrefixHit:
    """The longest run of cached full blocks that a request's tokens start with (see above).
    `block_hashes` are the request's own chained hashes of its full blocks (computed once,
    as its tokens arrived: `scheduler.request.Request.block_hashes`); `num_tokens` its
    tokens in all."""
    assert num_tokens > 0, "nothing to look up"
    assert len(block_hashes) == num_tokens // block_size, "hashes of every full block needed"
    blocks: list[int] = []
    hashes: list[BlockHash] = []
    for h in block_hashes:
        b = pool.lookup(h)
        if b is None:
            break
        blocks.append(b)
        hashes.append(h)
    n = num_tokens
    if len(blocks) * block_size < n:
        return PrefixHit(tuple(blocks), tuple(hashes), len(blocks) * block_size, None, n)
    return PrefixHit(tuple(blocks[:-1]), tuple(hashes[:-1]), n - 1, blocks[-1], n)


@dataclass
class PrefixCacheStats:
    """Counted once per admission (not per lookup of a request that had to wait)."""

    num_queries: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def record(self, hit: PrefixHit) -> None:
        self.num_queries += 1
        self.num_queried_tokens += hit.num_queried_tokens
        self.num_hit_tokens += hit.num_tokens
