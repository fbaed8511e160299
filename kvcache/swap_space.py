"""CPU blocks that hold the KV of requests preempted by swapping.

Each CPU block belongs to exactly one swapped-out request (no sharing, no hashes), so a
free list is all the bookkeeping. The runner owns the host tensors (pinned on CUDA).

A swap-in reads its CPU blocks during the runner's KV moves of the same step, so they must
not be handed to a swap-out of that step, which the runner makes first: `free_after_step`
parks them until `step_done`, which the scheduler calls once the runner made the moves.
"""

from collections import deque
from collections.abc import Iterable


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 0, f"num_cpu_blocks must be >= 0, got {num_blocks}"
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.pending: list[int] = []  # read by this step's swap-ins; free after the step

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free CPU blocks; never over-commits (callers check first)."""
        if n > len(self.free_blocks):
            raise RuntimeError(f"need {n} CPU blocks, only {len(self.free_blocks)} free")
        return [self.free_blocks.popleft() for _ in range(n)]

    def free(self, blocks: Iterable[int]) -> None:
        """Free now: blocks no move of the current step reads (an aborted request's)."""
        self.free_blocks.extend(blocks)

    def free_after_step(self, blocks: Iterable[int]) -> None:
        self.pending.extend(blocks)

    def step_done(self) -> None:
        self.free_blocks.extend(self.pending)
        self.pending.clear()

    def check_integrity(self, owned: Iterable[int]) -> None:
        """Every CPU block is exactly one of: free, pending, owned by one swapped request."""
        seen = [*self.free_blocks, *self.pending, *owned]
        assert len(set(seen)) == len(seen), "CPU block free, pending or owned twice"
        assert sorted(seen) == list(range(self.num_blocks)), "CPU block leaked or invented"
