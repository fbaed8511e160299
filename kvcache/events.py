"""Prefix-cache events, for a router's index of which blocks this worker holds (SMG's
cache-aware routing, through `worker.kv_events`).

The pool records them as the registry changes (engine thread, no locks, no callbacks) and
the engine takes them once per step (`BlockPool.take_events`), so they travel with that
step's outputs through the one thread hop the outputs already make (vLLM's
`take_events()`).
"""

from dataclasses import dataclass

from kvcache.block_hash import BlockHash


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive full blocks of one chain were registered. `parent` is the hash of the
    block before the first (None at the start of a sequence); `token_ids` are theirs, block
    after block (None where the cache does not know them: a swap-in)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...] | None
    cache_salt: str | None


@dataclass(frozen=True)
class BlocksRemoved:
    """Blocks were evicted: their hashes are no longer findable."""

    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllCleared:
    """Every hash was forgotten (a prefix-cache reset)."""


KVEvent = BlocksStored | BlocksRemoved | AllCleared
