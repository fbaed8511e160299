"""The shard plan of the Llama decoder over k ranks, and the slicing of a loaded model.

Per layer, as Megatron-LM splits it (and vLLM, nano-vllm)::

    qkv_proj      column-parallel: rank r keeps its query heads' rows and its KV heads'
    o_proj        row-parallel: the columns of its query heads, then one all-reduce
    gate_up_proj  column-parallel: its slice of gate's rows and of up's
    down_proj     row-parallel: the same slice of columns, then one all-reduce

so a layer costs two all-reduces of [tokens, hidden] and everything between them (rotary,
paged attention, the activation) runs on the rank's own heads and slice. The norms and the
residual stream are replicated: every rank holds the whole hidden state after each
all-reduce. The embedding and the LM head are vocab-parallel (vocab.py): a rank holds
ceil(V / k) of their rows (whole tiles of 32), the lookup is summed by one all-reduce a step
and the logits of the rows that sample are gathered to rank 0, which alone samples.

KV heads: with kv >= k each rank keeps kv/k of them (k must divide kv); with kv < k
(k a multiple of kv) each rank keeps the one KV head its query heads read, so each KV head
is replicated k/kv times (vLLM's rule). The KV cache of a rank holds only its heads.

Where the slices come from: a GGUF file is cut as it loads, on its own blocks
(gguf_split.py: `rows` and `cols` below, by whole blocks); a float load (safetensors,
dummy) is sliced here after it (`shard_model`); a pre-quantized folder is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from worker.models.llama import Linear, LlamaConfig
from worker.parallel.vocab import Gather, VocabShard, shard_vocab


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class ShardPlan:
    world: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: LlamaConfig, world: int) -> ShardPlan:
        """The plan, or a ValueError naming the number a split of `world` does not divide."""
        h, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        tp = f"--tensor-parallel-size {world}"
        if h % world:
            raise ValueError(f"{tp}: the model's {h} attention heads do not split over {world} "
                             f"ranks (sizes that divide them: {_divisors(h)})")
        if kv >= world and kv % world:
            raise ValueError(f"{tp}: the model's {kv} KV heads do not split over {world} ranks "
                             f"(sizes that divide them: {_divisors(kv)})")
        if kv < world and world % kv:
            raise ValueError(f"{tp}: {world} ranks cannot share the model's {kv} KV heads "
                             f"(with fewer KV heads than ranks, the size must be a multiple of {kv})")
        if inter % world:
            raise ValueError(f"{tp}: the model's intermediate size {inter} does not split over "
                             f"{world} ranks")
        return cls(world, h, kv, cfg.head_dim, inter, cfg.vocab_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.world

    def vocab(self, rank: int) -> VocabShard:
        """Rank `rank`'s rows of the embedding and the LM head (vocab.py)."""
        return VocabShard(self.vocab_size, self.world, rank)

    def q_heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        n = self.kv_heads_per_rank
        if self.num_kv_heads >= self.world:
            return range(rank * n, (rank + 1) * n)
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        first = self.q_heads(rank).start // group
        return range(first, first + 1)

    def config(self, cfg: LlamaConfig) -> LlamaConfig:
        """A rank's view of the model: its heads and MLP slice (the rest as it was)."""
        return dataclasses.replace(cfg, num_heads=self.heads_per_rank,
                                   num_kv_heads=self.kv_heads_per_rank,
                                   intermediate_size=self.intermediate_per_rank)

    def rows(self, rank: int) -> dict[str, tuple[range, ...]]:
        """Rank `rank`'s rows of each column-parallel weight, as rows of the fused weight:
        qkv_proj its query heads', then its KV heads' under k and under v; gate_up_proj its
        MLP slice under gate and under up."""
        d, n, i = self.head_dim, self.intermediate_per_rank, self.intermediate_size
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        kv = self.kv_heads(rank)
        return {"qkv_proj": (_span(self.q_heads(rank), d), _span(kv, d, q_size),
                             _span(kv, d, q_size + kv_size)),
                "gate_up_proj": (range(rank * n, (rank + 1) * n), range(i + rank * n, i + (rank + 1) * n))}

    def cols(self, rank: int) -> dict[str, range]:
        """Rank `rank`'s input columns of each row-parallel weight: o_proj its query heads',
        down_proj its MLP slice."""
        n = self.intermediate_per_rank
        return {"o_proj": _span(self.q_heads(rank), self.head_dim),
                "down_proj": range(rank * n, (rank + 1) * n)}

    def lora_slicer(self, rank: int) -> Callable[[str, torch.Tensor, torch.Tensor],
                                                  tuple[torch.Tensor, torch.Tensor]]:
        """Rank `rank`'s share of a LoRA adapter's (A [r, in], B [out, r]) for a PEFT
        projection, sliced as its base layer is: column-parallel q/k/v and gate/up keep B's
        rows of their heads or MLP slice (A whole); row-parallel o and down keep A's columns
        of their input slice (B whole), so their partial deltas sum in the all-reduce."""
        d, n = self.head_dim, self.intermediate_per_rank
        cpu = torch.device("cpu")
        heads = _index(_span(self.q_heads(rank), d), cpu)
        kv = _index(_span(self.kv_heads(rank), d), cpu)
        mlp = torch.arange(rank * n, (rank + 1) * n)
        b_rows = {"q_proj": heads, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
        a_cols = {"o_proj": heads, "down_proj": mlp}

        def sliced(proj: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if proj in b_rows:
                return a, b[b_rows[proj]]
            return a[:, a_cols[proj]], b

        return sliced

    def describe(self, rank: int) -> str:
        kv = self.kv_heads(rank)
        replicated = " (replicated)" if self.num_kv_heads < self.world else ""
        return (f"rank {rank}: query heads {self.q_heads(rank).start}-{self.q_heads(rank).stop - 1}, "
                f"KV heads {kv.start}-{kv.stop - 1}{replicated}, MLP slice "
                f"{self.intermediate_per_rank} of {self.intermediate_size}, {self.vocab(rank).describe()}")


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the ranks in place
    by `reduce` (one all-reduce). `delta` (a LoRA adapter's, on this rank's slice of A) is
    added to the partial product before the sum, which then adds up the whole delta."""

    sums_partials = True  # worker/models/llama.py `_linear` passes the LoRA delta in

    def __init__(self, inner: nn.Module, reduce: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.inner = inner
        self.reduce = reduce
        self.in_features = inner.in_features
        self.out_features = inner.out_features

    def forward(self, x: torch.Tensor,
                delta: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        y = self.inner(x)
        if delta is not None:
            y = delta(y)
        self.reduce(y)
        return y


def _float_linear(lin: nn.Module, what: str) -> nn.Linear:
    if type(lin) not in (nn.Linear, Linear):
        raise ValueError(f"tensor parallelism slices float linear layers; {what} is a "
                         f"{type(lin).__name__} (GGUF files are cut as they load; "
                         "pre-quantized checkpoints are not sliced yet)")
    return lin


def _sliced(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out, inp = weight.shape
    new = Linear(inp, out, bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return new


def _span(heads: range, head_dim: int, offset: int = 0) -> range:
    """The rows (or columns) of `heads`, each `head_dim` long, from `offset`."""
    return range(offset + heads.start * head_dim, offset + heads.stop * head_dim)


def _index(spans: tuple[range, ...] | range, device: torch.device) -> torch.Tensor:
    spans = (spans,) if isinstance(spans, range) else spans
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in spans])


def shard_model(model: nn.Module, plan: ShardPlan, rank: int,
                reduce: Callable[[torch.Tensor], None], gather: Gather, sliced: bool = False) -> None:
    """Make a loaded LlamaForCausalLM rank `rank`'s shard, in place (see the top): its float
    linears, embedding and head sliced (the full weights freed as the slices replace them),
    unless `sliced` (a GGUF load sliced as it loaded, worker/parallel/gguf_split.py: its
    weights are the rank's already, on the file's blocks or floats); then o_proj and
    down_proj wrapped to sum over the ranks (`reduce`: an all-reduce in place), the
    embedding to sum its lookup and the head to gather its logits to rank 0 (`gather`:
    rank 0's list of every rank's slice, None elsewhere). A row-parallel bias is added
    once, by rank 0, before the sum."""
    cfg = model.config
    if not sliced:
        _slice_floats(model, plan, rank)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallel(_without_bias(attn.o_proj) if rank else attn.o_proj, reduce)
        mlp.down_proj = RowParallel(_without_bias(mlp.down_proj) if rank else mlp.down_proj, reduce)
    shard_vocab(model, plan.vocab(rank), reduce, gather, sliced)
    if not sliced:
        model.config = plan.config(cfg)


def _without_bias(lin: nn.Module) -> nn.Module:
    if getattr(lin, "bias", None) is not None:
        lin.bias = None
    return lin


def _slice_floats(model: nn.Module, plan: ShardPlan, rank: int) -> None:
    d = model.config.head_dim
    rows, cols = plan.rows(rank), plan.cols(rank)
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        where = f"layer {index}"
        qkv = _float_linear(attn.qkv_proj, f"{where} qkv_proj")
        dev = qkv.weight.device
        qkv_rows = _index(rows["qkv_proj"], dev)
        attn.qkv_proj = _sliced(qkv, qkv.weight[qkv_rows], None if qkv.bias is None else qkv.bias[qkv_rows])
        o = _float_linear(attn.o_proj, f"{where} o_proj")
        attn.o_proj = _sliced(o, o.weight[:, _index(cols["o_proj"], dev)], o.bias)
        attn.num_heads, attn.num_kv_heads = plan.heads_per_rank, plan.kv_heads_per_rank
        attn.q_size, attn.kv_size = plan.heads_per_rank * d, plan.kv_heads_per_rank * d
        gu = _float_linear(mlp.gate_up_proj, f"{where} gate_up_proj")
        gu_rows = _index(rows["gate_up_proj"], dev)
        mlp.gate_up_proj = _sliced(gu, gu.weight[gu_rows], None if gu.bias is None else gu.bias[gu_rows])
        down = _float_linear(mlp.down_proj, f"{where} down_proj")
        mlp.down_proj = _sliced(down, down.weight[:, _index(cols["down_proj"], dev)], down.bias)
