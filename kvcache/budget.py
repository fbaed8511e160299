"""KV cache budget arithmetic: how many blocks a byte budget buys."""

from dataclasses import dataclass

GIB = 1 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token occupies across all layers: a key and a value (hence 2) per layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks that fit in `budget_bytes` (rounded down)."""
    assert block_size > 0 and bytes_per_token > 0
    return max(0, budget_bytes) // (block_size * bytes_per_token)


def fit_budget(budget: int, block_size: int, bytes_per_token: int, max_model_len: int) -> "KVBudget":
    """The blocks `budget` buys; ValueError when they cannot hold one request of
    `max_model_len` tokens (the engine refuses to start then)."""
    b = KVBudget.from_budget(budget, block_size, bytes_per_token, max_model_len)
    if b.num_tokens < max_model_len:
        raise ValueError(
            f"the KV cache ({b.num_tokens} tokens) cannot hold one request of --max-model-len "
            f"{max_model_len}; raise --kv-cache-memory-bytes or lower --max-model-len"
        )
    return b


@dataclass(frozen=True)
class KVBudget:
    budget_bytes: int
    block_size: int
    bytes_per_token: int
    num_blocks: int
    max_model_len: int

    @classmethod
    def from_budget(
        cls, budget_bytes: int, block_size: int, bytes_per_token: int, max_model_len: int
    ) -> "KVBudget":
        num_blocks = num_blocks_for_budget(budget_bytes, block_size, bytes_per_token)
        return cls(budget_bytes, block_size, bytes_per_token, num_blocks, max_model_len)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def cache_bytes(self) -> int:
        """Bytes the blocks actually take (at most `budget_bytes`)."""
        return self.num_tokens * self.bytes_per_token

    @property
    def max_concurrent_requests(self) -> int:
        """Requests of `max_model_len` tokens that fit at once (each rounded up to blocks)."""
        blocks_per_request = -(-self.max_model_len // self.block_size)
        return self.num_blocks // blocks_per_request

    def describe(self) -> str:
        return (
            f"KV cache: {self.cache_bytes / GIB:.2f} GiB = {self.num_blocks} blocks x "
            f"{self.block_size} tokens = {self.num_tokens} tokens; "
            f"{self.max_concurrent_requests} requests of {self.max_model_len} tokens at once"
        )
