"""Linear layers on the CPU through oneDNN, with each weight packed once at start-up.

`F.linear` on the CPU calls MKL's sgemm, which is slow for the few rows of a decode
step (on the project's AVX2 machine a 2-row product took about twice as long as a 1-row
one) and whose result for a row depends on how many rows share the call. oneDNN's matmul
over a weight reordered into its blocked layout was 1.3-3.2x faster from 1 to 64 rows,
and gives a row the same bits whatever the batch, so batching cannot change a row's
result at the matmul level. Figures: `python -m benchmarks.cpu_ops`, BENCHMARKS.md.

The packed weight is an opaque `torch._mkldnn` tensor; the plain one is dropped.
"""

from __future__ import annotations

import torch
from torch import nn

# The batch size oneDNN is told to pack for; the packed weight serves every batch size.
# 64 is the engine's default max_num_seqs (hints from 16 to 512 timed alike here).
_PACK_HINT_ROWS = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` for x: [rows, in_features], through oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: the packed layout is not a state_dict tensor.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a `PackedLinear` of its weights; returns
    how many were replaced (0 when already packed)."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count
