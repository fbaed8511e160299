"""A tensor-parallel rank's slices of a GGUF file, cut from the file's blocks as it loads
(worker/weights/gguf_load.py, `load_gguf(..., split=(world, rank))`): a rank never holds
the whole of a layer's linear, and it holds its share in the checkpoint's own quantized
blocks, for the same CPU kernels as TP = 1 (or dequantized where TP = 1 would be too).

- Column-parallel q/k/v and gate/up keep the rows `ShardPlan.rows` names: whole rows of
  blocks, for any type (the rows of the fused weight mapped onto the file's tensors: three
  attn_q/k/v or Phi-3's one attn_qkv).
- Row-parallel o_proj and down_proj keep the input columns `ShardPlan.cols` names: on the
  blocks only where they start and end on a block boundary (32 elements for Q4_0, Q4_1,
  Q5_0, Q5_1, Q8_0 and IQ4_NL; 256 for the K-quants and IQ4_XS), and the kernels take whole
  multiples of their k step. A split that a weight the kernels would hold at TP = 1 does
  not take is refused before anything is built, naming the numbers and the sizes that
  work; it is never dequantized in silence (--no-cpu-quantized-linear holds every linear
  dequantized, and floats are cut anywhere).
- Norms, biases of row-parallel layers (rank 0 adds them: shard.py), the embedding and the
  LM head stay whole; followers skip an untied head (rank 0 alone computes logits).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ops.quantized_linear import supports
from worker.models.llama import LlamaConfig
from worker.parallel.shard import ShardPlan
from worker.weights.gguf_piece import Piece

# A layer's weight or bias by this model's name: its module ("qkv_proj", "o_proj", ...).
_LAYER = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFSplit:
    plan: ShardPlan
    rank: int

    @classmethod
    def of(cls, cfg: LlamaConfig, world: int, rank: int, groups: dict[str, list[Piece]],
           quantized: bool) -> GGUFSplit:
        """Rank `rank`'s split, or a ValueError naming what does not divide: the heads or the
        MLP (ShardPlan.of), or, where the load holds the linears on their blocks
        (`quantized`), a weight's blocks."""
        plan = ShardPlan.of(cfg, world)
        why = _refusal(plan, groups, quantized)
        if why is not None:
            fits = [str(k) for k in range(1, cfg.num_heads + 1) if _fits(cfg, k, groups, quantized)]
            raise ValueError(f"--tensor-parallel-size {world}: {why}; sizes that work: {', '.join(fits)} "
                             "(or --no-cpu-quantized-linear: the linears dequantized, sliced anywhere)")
        return cls(plan, rank)

    def apply(self, groups: dict[str, list[Piece]]) -> dict[str, list[Piece]]:
        return {name: self.pieces(name, pieces) for name, pieces in groups.items()}

    def pieces(self, name: str, pieces: list[Piece]) -> list[Piece]:
        """The pieces of the weight `name` this rank keeps (see the top)."""
        m = _LAYER.match(name)
        if m is None:
            return pieces
        module, kind = m.group(2), m.group(3)
        rows = self.plan.rows(self.rank).get(module)
        if rows is not None:
            return _rows_of(pieces, rows)
        cols = self.plan.cols(self.rank).get(module)
        if cols is not None and kind == "weight":
            return [dataclasses.replace(p, cols=cols) for p in pieces]
        return pieces


def _rows_of(pieces: list[Piece], spans: tuple[range, ...]) -> list[Piece]:
    """`spans` (rows of the fused weight) as each piece's own rows; a piece left with none
    is dropped."""
    out, offset = [], 0
    for p in pieces:
        n = p.full_shape[0]
        mine = tuple(range(max(r.start, offset) - offset, min(r.stop, offset + n) - offset)
                     for r in spans if r.start < offset + n and r.stop > offset)
        if mine:
            out.append(dataclasses.replace(p, rows=mine))
        offset += n
    return out


def _refusal(plan: ShardPlan, groups: dict[str, list[Piece]], quantized: bool) -> str | None:
    """Why a rank's slices do not fall on the blocks of a linear the kernels would hold at
    TP = 1 (None: every one does). Every rank's slices have rank 0's sizes."""
    if not quantized:
        return None
    split = GGUFSplit(plan, 0)
    for name, whole in groups.items():
        m = _LAYER.match(name)
        if m is None or m.group(3) != "weight" or not all(supports(p.qtype, p.full_shape) for p in whole):
            continue
        where = f"layer {m.group(1)} {m.group(2)}"
        for p in split.pieces(name, whole):
            cols, rows = p.shape[1], p.shape[0]
            if p.cols is not None and cols % p.block_size:
                return (f"{where}: {cols} columns a rank is not a whole number of {p.qtype} blocks "
                        f"of {p.block_size}")
            if not supports(p.qtype, p.shape):
                return (f"{where}: a rank's {rows} x {cols} slice of {p.tensor.name} ({p.qtype}) is not "
                        "what the CPU kernels take (whole tiles of 32 rows, whole blocks of columns)")
    return None


def _fits(cfg: LlamaConfig, world: int, groups: dict[str, list[Piece]], quantized: bool) -> bool:
    try:
        plan = ShardPlan.of(cfg, world)
    except ValueError:
        return False
    return _refusal(plan, groups, quantized) is None
