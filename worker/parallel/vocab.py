"""The vocab-parallel embedding and LM head (Megatron-LM's; nano-vllm's VocabParallelEmbedding
and ParallelLMHead): rank r of k holds rows [r n, r n + n) of the embedding table, and of an
untied head (a tied head multiplies with the same rows), n = ceil(V / k) rounded up to whole
tiles of 32 rows (the CPU kernels' TILE: a rank's Q8_0 slice stays on its blocks), and rows
at or past V are zero (the padding, on the last ranks; cut after the gather).

- Lookup: a rank looks up the ids in its range and gives zero rows for the others; one
  all-reduce (sum) then gives every rank the whole hidden state. A row is one rank's plus
  zeros: TP = 1's row bit for bit (Gemma's scale multiplies it after, as at TP = 1).
- Head: every rank multiplies the same hidden rows with its rows of the head, and rank 0
  gathers the slices (dist.gather) into [rows, V]; a logit is the same dot product as at
  TP = 1, so anything done to the logits after (Gemma's soft-cap, masks, sampling) is done
  to TP = 1's logits, on rank 0 only. A follower's call returns its own slice (dropped).

Every rank must call the head for the same rows in the same order (the gather is a
collective): rank 0 sends each step's logits passes in its FORWARD message (messages.py),
and a step with none makes no gather on any rank.

Where the rows come from: a GGUF is cut as it loads (gguf_split.py: token_embd's and
output's rows are whole rows of blocks, the padding zero blocks), so no rank reads the whole
table into memory; a float load (safetensors, dummy) is cut here after it (`shard_vocab`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ops.quant_records import TILE
from worker.models.llama import Embedding, Linear

Gather = Callable[[torch.Tensor], list[torch.Tensor] | None]  # None on a follower


@dataclass(frozen=True)
class VocabShard:
    """Rank `rank`'s rows of a vocabulary of `vocab_size` split over `world` ranks."""

    vocab_size: int
    world: int
    rank: int

    @property
    def rows_per_rank(self) -> int:
        """Every rank's table rows, padding included: ceil(V / k) in whole tiles."""
        n = -(-self.vocab_size // self.world)
        return -(-n // TILE) * TILE

    @property
    def rows(self) -> range:
        """The vocabulary's rows this rank holds (before its padding; maybe none)."""
        n, v = self.rows_per_rank, self.vocab_size
        return range(min(self.rank * n, v), min((self.rank + 1) * n, v))

    @property
    def padding(self) -> int:
        return self.rows_per_rank - len(self.rows)

    def cut(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [V, hidden] float weight, zero rows after them."""
        rows = self.rows
        out = weight.new_zeros((self.rows_per_rank, weight.shape[1]))
        out[: len(rows)] = weight[rows.start : rows.stop]
        return out

    def describe(self) -> str:
        if not self.rows:
            return f"no vocab rows ({self.padding} zero rows)"
        pad = f" (+{self.padding} zero rows)" if self.padding else ""
        return f"vocab rows {self.rows.start}-{self.rows.stop - 1}{pad}"


class VocabParallelEmbedding(nn.Module):
    """A rank's lookup in its rows, summed over the ranks by `reduce` (see the top)."""

    def __init__(self, inner: nn.Module, shard: VocabShard, reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        assert inner.num_embeddings == shard.rows_per_rank, (inner.num_embeddings, shard)
        self.inner = inner
        self.reduce = reduce
        self.start, self.count = shard.rows.start, len(shard.rows)
        self.num_embeddings = shard.vocab_size
        self.embedding_dim = inner.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        others = (local < 0) | (local >= self.count)
        x = self.inner(local.masked_fill(others, 0))
        x = x.masked_fill(others.unsqueeze(-1), 0.0)
        self.reduce(x)
        return x


class VocabParallelHead(nn.Module):
    """A rank's logits for its rows, gathered to rank 0 into [rows, V] (see the top)."""

    def __init__(self, inner: nn.Module, shard: VocabShard, gather: Gather) -> None:
        super().__init__()
        assert inner.out_features == shard.rows_per_rank, (inner.out_features, shard)
        self.inner = inner
        self.gather = gather
        self.vocab_size = shard.vocab_size
        self.in_features = inner.in_features
        self.out_features = shard.vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mine = self.inner(hidden).contiguous()
        parts = self.gather(mine)
        if parts is None:  # a follower: rank 0 has them all
            return mine
        logits = torch.cat(parts, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size].contiguous()


def _float_table(embed: nn.Module) -> nn.Embedding:
    if type(embed) not in (nn.Embedding, Embedding):
        raise ValueError(f"tensor parallelism slices a float embedding table; this one is a "
                         f"{type(embed).__name__} (GGUF files are cut as they load)")
    return embed


def shard_vocab(model: nn.Module, shard: VocabShard, reduce: Callable[[torch.Tensor], None],
                gather: Gather, sliced: bool) -> None:
    """Make `model`'s embedding and LM head rank `shard.rank`'s, in place: cut to its rows
    unless `sliced` (a GGUF cut as it loaded: they hold its rows already), then wrapped to
    sum and gather over the ranks. A tied model's head is the table's rows (or the load's
    tied head on them, the GGUF's QuantLinear), shared, not copied."""
    if not sliced:
        table = _float_table(model.embed_tokens)
        model.embed_tokens = _table(shard.cut(table.weight))
        if model.lm_head is not None:  # untied: the head's rows too (the full ones freed)
            model.lm_head = _rows(shard.cut(model.lm_head.weight))
    head = model.lm_head if model.lm_head is not None else model.tied_head
    if head is None:  # tied to a float table: a linear over the same storage
        head = _rows(model.embed_tokens.weight)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, shard, reduce)
    model.lm_head = VocabParallelHead(head, shard, gather)
    model.tied_head = None


def _table(weight: torch.Tensor) -> Embedding:
    e = Embedding(*weight.shape, device="meta")
    e.weight = nn.Parameter(weight, requires_grad=False)
    return e


def _rows(weight: torch.Tensor | nn.Parameter) -> Linear:
    lin = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return lin
