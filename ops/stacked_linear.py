"""One linear layer whose rows come in groups of different kinds: a fused q/k/v of a GGUF
file that stores v in another block type than q and k (llama-quantize's Q4_K_M gives half
the layers a Q6_K attn_v beside Q4_K q and k). Each group keeps its own kernel; the outputs
are concatenated as the fused weight's rows are."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class StackedLinear(nn.Module):
    """`y = cat([part(x) for part in parts], -1)`: the parts' rows stacked, in order."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        assert len({p.in_features for p in parts}) == 1, [p.in_features for p in parts]
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
