"""Where keys and values live: block pool, per-request block tables, budget arithmetic.

Pure bookkeeping: imports nothing of ours, no torch.
"""

from kvcache.block_pool import BlockPool
from kvcache.budget import KVBudget, kv_bytes_per_token, num_blocks_for_budget
from kvcache.manager import KVCacheManager

__all__ = [
    "BlockPool",
    "KVBudget",
    "KVCacheManager",
    "kv_bytes_per_token",
    "num_blocks_for_budget",
]
