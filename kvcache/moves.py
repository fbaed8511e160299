"""The KV copies of one step, which the runner makes before that step's forward pass.

    1. swap_out  (gpu, cpu)   victims' computed blocks to host memory
    2. swap_in   (cpu, gpu)   resumed requests' blocks back, into fresh GPU blocks
    3. copy      (src, dst)   copy-on-write of a cached block a request must write into
    4. forward               writes the scheduled positions' keys and values

Each kind is batched (one gather/scatter per layer), in this order. Why the order is safe,
although the scheduler frees and reallocates blocks freely within one step:

- A victim's GPU blocks are freed when it is swapped out and may be handed out again in
  the same step (as swap-in or copy destinations, or for the forward to write). Every
  write comes after step 1, which has read them by then.
- A swapped-out block that was cached keeps its hash: its contents stay valid (step 1
  only reads), so a request admitted in the same step may share it or copy from it.
- A resumed request's new GPU blocks are registered in the prefix cache at once, so a
  request admitted later in the same step may share them (read by step 4) or copy from
  them (step 3): both come after step 2 wrote them.
- The CPU blocks a swap-in reads are not reused by a swap-out of the same step (which
  would overwrite them first): `SwapSpace.free_after_step` holds them back.
- A copy's source is pinned (an extra reference) until the runner made the step's moves,
  so it cannot be evicted and rewritten by step 2 before step 3 reads it.
- No block is written by steps 2-3 and then swapped out in the same step (step 1 would
  read it before it was written): a request admitted or resumed in a step ranks ahead of
  everything preempted after it in that step. `KVCacheManager.swap_out` asserts it.
- A running request may copy its shared half-full block (a forked sample's copy-on-write)
  and then be displaced in the same step by a more urgent arrival. Its copy is undone
  first (`KVCacheManager._undo_copy`): its table holds the source again, which step 1
  reads for a swap, and the unwritten destination is freed, never a second move's target.
"""

from dataclasses import dataclass, field


@dataclass
class KVMoves:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src_gpu, dst_gpu)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)

    def check(self) -> None:
        """The ordering argument above holds for this step's moves."""
        written = [g for _, g in self.swap_in] + [d for _, d in self.copy]
        assert len(set(written)) == len(written), "a GPU block written twice in one step"
        cpu_out = [c for _, c in self.swap_out]
        assert len(set(cpu_out)) == len(cpu_out), "a CPU block written twice in one step"
        assert not set(cpu_out) & {c for c, _ in self.swap_in}, "CPU block reused in its step"
