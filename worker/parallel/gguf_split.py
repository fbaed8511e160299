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
- The embedding and an untied LM head keep the rank's vocabulary rows (ShardPlan.vocab):
  whole rows of blocks, then zero rows (zero blocks) to ceil(V / k) in whole tiles of 32,
  so a rank's Q8_0 table stays on its blocks (worker/parallel/vocab.py).
- Norms and biases of row-parallel layers (rank 0 adds them: shard.py) stay whole.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ops.quantized_linear import supports
from worker.models.llama import LlamaConfig
from worker.parallel.shard import ShardPlan

if TYPE_CHECKING:  # worker.weights' loader imports this module: no import back at run time
    from worker.weights.gguf_piece import Piece

# A layer's weight or bias by this model's name: its module ("qkv_proj", "o_proj", ...).
_LAYER = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")
VOCAB_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")  # split by vocabulary rows


@dataclass(frozen=True)
class GGUFSplit:
    plan: ShardPlan
    rank: int

    @classmethod
    def of(cls, cfg: LlamaConfig, world: int, rank: int, groups: dict[str, list[Piece]],
           quantized: bool) -> GGUFSplit:
        """Rank `rank`'s split, or a ValueError naming what does not divide (`check`)."""
        shapes = {name: [(p.qtype, p.full_shape) for p in pieces] for name, pieces in groups.items()}
        return cls(check(cfg, world, shapes, quantized), rank)

    def apply(self, groups: dict[str, list[Piece]]) -> dict[str, list[Piece]]:
        return {name: self.pieces(name, pieces) for name, pieces in groups.items()}

    def pieces(self, name: str, pieces: list[Piece]) -> list[Piece]:
        """The pieces of the weight `name` this rank keeps (see the top)."""
        if name in VOCAB_WEIGHTS:
            vocab = self.plan.vocab(self.rank)
            return [dataclasses.replace(p, rows=(vocab.rows,), pad_rows=vocab.padding) for p in pieces]
        m = _LAYER.match(name)
        if m is None:
            return pieces
        module, kind = m.group(2), m.group(3)
        rows = self.plan.rows(self.rank).get(module)
        if rows is not None:  # a piece left with none of its rows is dropped
            mine = _rows_of([p.full_shape[0] for p in pieces], rows)
            return [dataclasses.replace(p, rows=r) for p, r in zip(pieces, mine, strict=True) if r]
        cols = self.plan.cols(self.rank).get(module)
        if cols is not None and kind == "weight":
            return [dataclasses.replace(p, cols=cols) for p in pieces]
        return pieces


def check(cfg: LlamaConfig, world: int, weights: Mapping[str, Sequence[tuple[str, tuple[int, ...]]]],
          quantized: bool) -> ShardPlan:
    """The plan of `world` ranks, or a ValueError naming what does not divide: the heads or
    the MLP (ShardPlan.of), or, where the linears are held on their blocks (`quantized`), a
    weight's blocks, with the sizes that work. `weights`: by this model's name, each weight's
    pieces as (stored type, (out, in)) in row order (the loader's or the planner's)."""
    plan = ShardPlan.of(cfg, world)
    why = _refusal(plan, weights, quantized)
    if why is not None:
        fits = [str(k) for k in range(1, cfg.num_heads + 1) if _fits(cfg, k, weights, quantized)]
        raise ValueError(f"--tensor-parallel-size {world}: {why}; sizes that work: {', '.join(fits)} "
                         "(or --no-cpu-quantized-linear: the linears dequantized, sliced anywhere)")
    return plan


def _rows_of(counts: list[int], spans: tuple[range, ...]) -> list[tuple[range, ...]]:
    """`spans` (rows of the fused weight) as each piece's own rows, for pieces of `counts`
    rows in row order (an empty tuple: none of its rows)."""
    out, offset = [], 0
    for n in counts:
        out.append(tuple(range(max(r.start, offset) - offset, min(r.stop, offset + n) - offset)
                         for r in spans if r.start < offset + n and r.stop > offset))
        offset += n
    return out


def _refusal(plan: ShardPlan, weights: Mapping[str, Sequence[tuple[str, tuple[int, ...]]]],
             quantized: bool) -> str | None:
    """Why a rank's slices do not fall on the blocks of a linear the kernels would hold at
    TP = 1 (None: every one does). Every rank's slices have rank 0's sizes."""
    if not quantized:
        return None
    rows, cols = plan.rows(0), plan.cols(0)
    for name, whole in weights.items():
        m = _LAYER.match(name)
        if m is None or m.group(3) != "weight" or not all(supports(q, shape) for q, shape in whole):
            continue
        where, module = f"layer {m.group(1)} {m.group(2)}", m.group(2)
        if module not in rows and module not in cols:
            continue
        if module in cols:
            parts = [(q, (shape[0], len(cols[module]))) for q, shape in whole]
        else:
            counts = _rows_of([shape[0] for _, shape in whole], rows[module])
            parts = [(q, (sum(len(r) for r in mine), shape[1])) for (q, shape), mine in zip(whole, counts, strict=True)
                     if mine]
        for qtype, (out, n) in parts:
            block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
            if n % block:
                return f"{where}: {n} columns a rank is not a whole number of {qtype} blocks of {block}"
            if not supports(qtype, (out, n)):
                return (f"{where}: a rank's {out} x {n} slice ({qtype}) is not what the CPU kernels take "
                        "(whole tiles of 32 rows, whole blocks of columns)")
    return None


def _fits(cfg: LlamaConfig, world: int, weights: Mapping[str, Sequence[tuple[str, tuple[int, ...]]]],
          quantized: bool) -> bool:
    try:
        plan = ShardPlan.of(cfg, world)
    except ValueError:
        return False
    return _refusal(plan, weights, quantized) is None
