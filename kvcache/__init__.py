"""Where keys and values live: block pool, per-request block tables, prefix cache, CPU swap
space, budget arithmetic.

Pure bookkeeping: imports nothing of ours, no torch.
"""

from kvcache.block_hash import ROOT, BlockHash, hash_block, iter_block_hashes
from kvcache.block_pool import BlockPool
from kvcache.budget import KVBudget, kv_bytes_per_token, num_blocks_for_budget
from kvcache.manager import KVCacheManager
from kvcache.moves import KVMoves
from kvcache.prefix_cache import PrefixCacheStats, PrefixHit
from kvcache.swap_space import SwapSpace

__all__ = [
    "ROOT",
    "BlockHash",
    "BlockPool",
    "KVBudget",
    "KVCacheManager",
    "KVMoves",
    "PrefixCacheStats",
    "PrefixHit",
    "SwapSpace",
    "hash_block",
    "iter_block_hashes",
    "kv_bytes_per_token",
    "num_blocks_for_budget",
]
