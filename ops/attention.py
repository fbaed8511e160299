"""Paged attention over a mixed batch (prefill chunks and decodes together).

Layout of one step (three requests: a decode, a prefill chunk, a decode)::

    q (flat tokens)      | a | b0 b1 b2 b3 | c |        T = 6 query tokens
    query_start_loc      0   1             5   6      [B + 1]
    seq_lens             9   7                 30     [B]  context incl. this step
    query positions      8   3 4 5 6           29     seq_len - q_len + i

    k_cache[block, offset]: request r's token at position p lives in block
    block_tables[r, p // block_size] at offset p % block_size.

Each query token attends causally to every cached key at a position <= its own; with a
sliding window w (`window`, a layer's own: ModelConfig.window_of), only to the keys in
(position - w, position], transformers' window.

`paged_attention_ref` is the torch reference (pure torch, no state between calls): decodes
run as batched SDPA calls over their keys gathered by block table, grouped by context
length; each prefill chunk runs alone with its causal mask offset by the context before it.
The grouping, gather tables and masks (an `AttentionPlan`) depend only on the step's
metadata, which every layer of the step passes: given a `StepPlan` (one per step, held by
the step's `AttentionMetadata`), the first layer builds the plan and the others reuse it;
without one, each call builds its own. The C backend (`paged_attention_c`,
ops/cpu_attention.py) shares the plan and the prefill path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[n, max_blocks] tables -> [n, Hkv, num_blocks * block_size, D]."""
    # index_select copies whole blocks; advanced indexing (cache[tables]) copies element
    # by element on the CPU and cost several times more (benchmarks/cpu_ops.py).
    g = cache.index_select(0, tables[:, :num_blocks].reshape(-1))  # [n * nblk, bs, Hkv, D]
    return g.view(tables.shape[0], num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


@dataclass
class _Prefill:
    start: int  # first query row
    end: int
    table: torch.Tensor  # [1, blocks from the first one any row's window reaches]
    num_blocks: int
    mask: torch.Tensor  # [q_len, num_blocks * block_size] bool, causal from the cached context


def _prefill(block_tables: torch.Tensor, r: int, n: int, start: int, end: int, block_size: int,
             window: int | None) -> _Prefill:
    """Request r's chunk: query rows start..end-1 over its n tokens. Row i sits at position
    n - q_len + i and sees keys (position - window, position]: the gather starts at the block
    of the first row's first key, so a windowed chunk reads its window, not its context."""
    q_len, device = end - start, block_tables.device
    first = 0 if window is None else max(0, n - q_len - window + 1) // block_size
    nblk = -(-n // block_size) - first
    q_pos = torch.arange(n - q_len, n, device=device)[:, None]
    keys = first * block_size + torch.arange(nblk * block_size, device=device)[None, :]
    mask = keys <= q_pos
    if window is not None:
        mask &= keys > q_pos - window
    return _Prefill(start, end, block_tables[r : r + 1, first:], nblk, mask)


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # query rows (one per request), int64
    tables: torch.Tensor  # [n, max_blocks]
    num_blocks: int
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool: seq_len - window <= keys < seq_len


@dataclass
class DecodeBatch:
    """Every decode of the step at once, for the C kernel: int64, contiguous."""

    rows: torch.Tensor  # [n] query rows
    tables: torch.Tensor  # [n, max_blocks]
    lens: torch.Tensor  # [n] context lengths


class AttentionPlan:
    """What the torch and C paths need to know of one step's batch, built from its metadata
    with one host read of the lengths: each prefill chunk's table and causal mask, and the
    decodes, grouped by context length (for SDPA) or all at once (for the C kernel; each
    form built on first use, the masks once per window the step's layers have). Keeps the
    metadata tensors it was built from, to check that later calls pass the same ones."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, block_size: int) -> None:
        self.block_tables, self.seq_lens, self.query_start_loc = block_tables, seq_lens, query_start_loc
        self.block_size = block_size
        lens, starts = seq_lens.tolist(), query_start_loc.tolist()
        self.lens = lens
        self._chunks: list[tuple[int, int, int, int]] = []  # (request, length, first row, end)
        # log2 bucket of context length -> decode request indices: within a bucket, padding
        # to the longest at most doubles the keys read.
        self.buckets: dict[int, list[int]] = {}
        for r, n in enumerate(lens):
            if starts[r + 1] - starts[r] == 1:
                self.buckets.setdefault((n - 1).bit_length(), []).append(r)
            else:
                self._chunks.append((r, n, starts[r], starts[r + 1]))
        self._prefills: dict[int | None, list[_Prefill]] = {}
        self._groups: dict[int | None, list[_DecodeGroup]] = {}

    def matches(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, block_size: int) -> bool:
        return (block_tables is self.block_tables and seq_lens is self.seq_lens
                and query_start_loc is self.query_start_loc and block_size == self.block_size)

    def prefills_for(self, window: int | None) -> list[_Prefill]:
        """Each prefill chunk's table and mask for a layer of this window (None: global)."""
        if window not in self._prefills:
            self._prefills[window] = [_prefill(self.block_tables, r, n, s, e, self.block_size, window)
                                      for r, n, s, e in self._chunks]
        return self._prefills[window]

    def decode_groups_for(self, window: int | None) -> list[_DecodeGroup]:
        """The decodes grouped for SDPA, masked to keys [seq_len - window, seq_len)."""
        if window in self._groups:
            return self._groups[window]
        groups = []
        for reqs in self.buckets.values():
            idx = torch.tensor(reqs, device=self.block_tables.device)
            nblk = -(-max(self.lens[r] for r in reqs) // self.block_size)
            keys = torch.arange(nblk * self.block_size, device=idx.device)[None, :]
            lens = self.seq_lens[idx].long()[:, None]
            mask = keys < lens
            if window is not None:
                mask &= keys >= lens - window
            groups.append(_DecodeGroup(self.query_start_loc[idx].long(),
                                       self.block_tables.index_select(0, idx), nblk, mask[:, None, None, :]))
        self._groups[window] = groups
        return groups

    @functools.cached_property
    def decodes(self) -> DecodeBatch | None:
        if not self.buckets:
            return None
        all_decodes = sorted(r for reqs in self.buckets.values() for r in reqs)
        idx = torch.tensor(all_decodes, dtype=torch.long, device=self.block_tables.device)
        return DecodeBatch(self.query_start_loc.index_select(0, idx).long().contiguous(),
                           self.block_tables.index_select(0, idx).long().contiguous(),
                           self.seq_lens.index_select(0, idx).long().contiguous())


class StepPlan:
    """One step's `AttentionPlan`, built by the first layer that runs the torch or C path
    and reused by the rest. One per step: the runner puts a new one in each step's
    `AttentionMetadata`, so a plan never outlives its step (later calls must pass the very
    tensors it was built from: asserted). The Triton kernel never builds one: it reads the
    metadata on the device (a plan reads lengths on the host, which a CUDA graph cannot)."""

    __slots__ = ("_plan",)

    def __init__(self) -> None:
        self._plan: AttentionPlan | None = None

    def get(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
            block_size: int) -> AttentionPlan:
        plan = self._plan
        if plan is None:
            plan = self._plan = AttentionPlan(block_tables, seq_lens, query_start_loc, block_size)
        assert plan.matches(block_tables, seq_lens, query_start_loc, block_size), (
            "a StepPlan serves one step: every call must pass that step's metadata tensors")
        return plan

    @property
    def built(self) -> bool:
        return self._plan is not None


def plan_for(step: StepPlan | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
             query_start_loc: torch.Tensor, block_size: int) -> AttentionPlan:
    """The step's shared plan, or a plan of this call's own."""
    if step is None:
        return AttentionPlan(block_tables, seq_lens, query_start_loc, block_size)
    return step.get(block_tables, seq_lens, query_start_loc, block_size)


def read_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached keys or values in `dtype`: an fp8 cache holds x / scale (its per-tensor scale,
    --kv-cache-dtype fp8), read back as fp8 -> float32, times scale, -> dtype."""
    if x.dtype == torch.float8_e4m3fn:
        return (x.to(torch.float32) * scale).to(dtype)
    return x.to(dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, gqa: bool,
          softcap: float | None) -> torch.Tensor:
    """SDPA, or with `softcap` (Gemma 2) the same with the scores soft-capped before the mask
    as transformers does: softcap * tanh(q.k scale / softcap) (SDPA has no such hook)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32).to(q.dtype) @ v


def attend_prefills(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, scale: float, out: torch.Tensor, window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, softcap: float | None = None) -> None:
    """out[chunk] for every prefill chunk of the plan, one SDPA call each."""
    gqa = q.shape[1] != k_cache.shape[2]
    for p in plan.prefills_for(window):
        k = read_cache(_gather(k_cache, p.table, p.num_blocks), q.dtype, k_scale)
        v = read_cache(_gather(v_cache, p.table, p.num_blocks), q.dtype, v_scale)
        chunk = q[p.start : p.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        o = _sdpa(chunk, k, v, p.mask, scale, gqa, softcap)
        out[p.start : p.end] = o[0].transpose(0, 1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: StepPlan | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]
    int32/64; seq_lens: [B]; query_start_loc: [B + 1]. Returns [T, Hq, D]. `k_scale`,
    `v_scale`: an fp8 cache's per-tensor scales (`read_cache`).

    The torch reference. `plan`: the step's shared plan (see the module docstring); None
    builds one for this call. max_query_len and max_seq_len are not needed here. `window`:
    the layer's sliding window (keys in (position - window, position]), None: global; the
    decodes' keys are masked to it, each prefill chunk's gathered from its window's blocks.
    `softcap`: tanh soft-capping of the scaled scores (Gemma 2), None: none.
    """
    p = plan_for(plan, block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    out = torch.empty_like(q)
    attend_prefills(p, q, k_cache, v_cache, scale, out, window, k_scale, v_scale, softcap)
    gqa = q.shape[1] != k_cache.shape[2]
    for g in p.decode_groups_for(window):
        k = read_cache(_gather(k_cache, g.tables, g.num_blocks), q.dtype, k_scale)
        v = read_cache(_gather(v_cache, g.tables, g.num_blocks), q.dtype, v_scale)
        o = _sdpa(q.index_select(0, g.rows)[:, :, None], k, v, g.mask, scale, gqa, softcap)
        out.index_copy_(0, g.rows, o[:, :, 0])
    return out
