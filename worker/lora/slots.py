"""The device-side slots of the adapters a step uses: --max-loras of them, stacked per
linear layer as ops/lora.py reads them.

Each slot holds one adapter's A and B for every layer, zero-padded to --max-lora-rank (a
rank-8 adapter in rank-16 slots adds exact zeros) and zero where the adapter does not
target a projection, with the adapter's scale folded into B. A step's adapters keep the
slots they already hold; a new one takes a free slot, else the least recently used slot
of an adapter not in this step (the scheduler admits at most --max-loras adapters to the
running set, so one is always there). The stacks are allocated once, at start-up: loading
and unloading adapters never allocates device memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from ops.lora import LoraRows, LoraStack
from worker.lora.adapter import LoraAdapter, module_shapes
from worker.models.llama import LlamaConfig, StepLora

# (PEFT projection, A, B) -> this rank's (A, B): ShardPlan.lora_slicer.
Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Our fused linears and the PEFT projections they run, in the order of their output rows
# (worker/models/llama.py FUSED_ORDER).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _b_stack(slots: int, out: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [slots, out, rank] stack of B. On the CPU it is stored transposed ([slots, rank,
    out], viewed back): the fused decoder's expand reads a row of `out` per rank
    (ops/cpu_kernels/lora.c); torch's bmm takes either layout, Triton's kernel a contiguous one."""
    if device.type == "cpu":
        return torch.zeros(slots, rank, out, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(slots, out, rank, dtype=dtype, device=device)


class LoraSlots:
    def __init__(self, cfg: LlamaConfig, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, shard: Shard | None = None) -> None:
        """Slots for a model of config `cfg`. Under tensor parallelism `cfg` is the rank's
        (its heads and MLP slice) and `shard` cuts each adapter's full A and B to the rank's
        share (ShardPlan.lora_slicer)."""
        assert max_loras >= 1 and max_rank >= 1
        self.shard = shard
        # Called with (slot, adapter) after each write: rank 0 of a tensor-parallel group
        # sends the followers the same write (worker/parallel/lora.py).
        self.on_write: Callable[[int, LoraAdapter], None] | None = None
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = device, dtype
        shapes = module_shapes(cfg)
        self.layers: list[dict[str, LoraStack]] = []
        for _ in range(cfg.num_layers):
            stacks = {}
            for group, projs in GROUPS.items():
                n_in = shapes[projs[0]][0]
                a = torch.zeros(max_loras, len(projs) * max_rank, n_in, dtype=dtype, device=device)
                bs = [_b_stack(max_loras, shapes[p][1], max_rank, dtype, device) for p in projs]
                stacks[group] = LoraStack(a, bs)
            self.layers.append(stacks)
        self.uids: list[int | None] = [None] * max_loras  # the adapter (uid) each slot holds
        # The linears each slot's adapter targets: a step skips the others (all zeros).
        self.groups: list[frozenset[str]] = [frozenset()] * max_loras
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self.num_writes = 0  # adapters copied into a slot (misses of the slot cache)

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + sum(b.nbytes for b in s.bs) for layer in self.layers
                   for s in layer.values())

    def assign(self, adapters: Sequence[LoraAdapter]) -> dict[int, int]:
        """Slots for this step's adapters (uid -> slot), copying in those not resident."""
        need = {a.uid: a for a in adapters}
        assert len(need) <= self.max_loras, f"{len(need)} adapters in a step, --max-loras {self.max_loras}"
        now = next(self._clock)
        slot_of = {uid: i for i, uid in enumerate(self.uids) if uid in need}
        # Free slots first, then the least recently used of adapters not in this step.
        spare = sorted((i for i, uid in enumerate(self.uids) if uid not in need),
                       key=lambda i: (self.uids[i] is not None, self._last_used[i]))
        for uid, adapter in need.items():
            if uid not in slot_of:
                slot_of[uid] = slot = spare.pop(0)
                self._write(slot, adapter)
        for slot in slot_of.values():
            self._last_used[slot] = now
        return slot_of

    def step(self, token_slots: Sequence[int]) -> StepLora | None:
        """The step's LoRA input for the model: None when no token has an adapter."""
        rows = LoraRows.build(token_slots, self.max_loras, self.device)
        if rows is None:
            return None
        groups = frozenset().union(*(self.groups[s] for s in set(token_slots) if s >= 0))
        layers = self.layers if len(groups) == len(GROUPS) else [
            {g: st for g, st in layer.items() if g in groups} for layer in self.layers]
        return StepLora(rows, layers, token_slots)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` as rank 0 chose it (a tensor-parallel follower)."""
        if not 0 <= slot < self.max_loras or adapter.rank > self.max_rank:
            raise ValueError(f"a LoRA write of rank {adapter.rank} into slot {slot}; this rank has "
                             f"{self.max_loras} slots of rank {self.max_rank}")
        self._write(slot, adapter)

    @torch.inference_mode()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        r, scale = adapter.rank, adapter.scale
        for layer, stacks in enumerate(self.layers):
            for group, projs in GROUPS.items():
                st = stacks[group]
                st.a[slot].zero_()
                for i, proj in enumerate(projs):
                    b = st.bs[i][slot]
                    b.zero_()
                    w = adapter.weights.get((layer, proj))
                    if w is None:
                        continue  # not targeted: zeros, adds nothing
                    a_w, b_w = w if self.shard is None else self.shard(proj, *w)
                    st.a[slot, i * self.max_rank : i * self.max_rank + r].copy_(a_w)
                    b[:, :r].copy_(b_w * scale)
        self.uids[slot] = adapter.uid
        targets = set(adapter.config.target_modules)
        self.groups[slot] = frozenset(g for g, projs in GROUPS.items() if targets & set(projs))
        self.num_writes += 1
        if self.on_write is not None:
            self.on_write(slot, adapter)
