"""Batched LoRA: every row of a step gets its own adapter's low-rank delta, for all the
adapters of the step in one gathered computation (the segmented matmul of Punica's SGMV).

The adapters of a step sit in slots of stacked weights, one stack per linear layer (the
runner fills them, worker/lora/slots.py)::

    a    [num_slots, n * r, in]      A of each of the layer's n output slices, stacked on r
    bs   n x [num_slots, out_i, r]   B of each slice, the adapter's scale folded in

A fused layer (q/k/v, gate/up) has n slices sharing the input: one shrink for all of them,
then one expand per slice into its columns of y. Rows are grouped by adapter into segments,
padded to the longest (`LoraRows`)::

    tokens        t0 t1 t2 t3 t4 t5          slots  -  1  0  1  -  0      (- = base model)
    gather_rows   [[t2 t5 T ],               slot 0   (T: an appended zero row)
                   [t1 t3 T ]]               slot 1   (padding to the longest segment)
    h = x[gather_rows] @ a[slot].T           one bmm: [S, L, n * r]
    y[rows, slice] += h[slice] @ b[slot].T   one bmm per slice, added back by index_add_

Base rows are never touched (their bits are those of the base model in any batch); padding
rows are zeros, so they add exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class LoraRows:
    """Where one step's LoRA rows are: built once per step, read by every layer."""

    gather_rows: torch.Tensor  # [S, L] int64: token rows by segment; T (a zero row) pads
    scatter_rows: torch.Tensor  # [S, L] int64: the same with padding -> 0 (adds zeros there)
    slots: torch.Tensor | None  # [S] int64 slot of each segment; None = every slot, in order

    @classmethod
    def build(cls, token_slots: Sequence[int], num_slots: int, device: torch.device) -> LoraRows | None:
        """From each token's slot (-1: the base model); None when no token has an adapter."""
        segments: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                segments.setdefault(slot, []).append(row)
        if not segments:
            return None
        order = sorted(segments)
        longest = max(len(r) for r in segments.values())
        t = len(token_slots)
        gather = [segments[s] + [t] * (longest - len(segments[s])) for s in order]
        scatter = [segments[s] + [0] * (longest - len(segments[s])) for s in order]
        every = order == list(range(num_slots))
        return cls(torch.tensor(gather, dtype=torch.int64).to(device, non_blocking=True),
                   torch.tensor(scatter, dtype=torch.int64).to(device, non_blocking=True),
                   None if every else torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True))


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
                 rows: LoraRows) -> torch.Tensor:
    """y[t, slice i] += (x[t] @ a[s, i*r:(i+1)*r].T) @ bs[i][s].T for each token t of slot s
    (see the module docstring), in place; returns y. y: [T, sum(out_i)], x: [T, in]."""
    if rows.slots is not None:  # only the step's slots (a copy of theirs, not of all)
        a = a.index_select(0, rows.slots)
        bs = [b.index_select(0, rows.slots) for b in bs]
    xz = torch.cat([x, x.new_zeros(1, x.shape[1])])
    h = torch.bmm(xz[rows.gather_rows], a.transpose(1, 2))  # [S, L, n * r]
    r = bs[0].shape[2]
    parts = [torch.bmm(h[..., i * r:(i + 1) * r], b.transpose(1, 2)) for i, b in enumerate(bs)]
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [S, L, out]
    y.index_add_(0, rows.scatter_rows.reshape(-1), delta.reshape(-1, delta.shape[-1]))
    return y


@dataclass
class LoraStack:
    """One linear layer's adapter slots: `a` [num_slots, n * r, in] and one `bs` entry
    [num_slots, out_i, r] per output slice (see the module docstring)."""

    a: torch.Tensor
    bs: list[torch.Tensor]
