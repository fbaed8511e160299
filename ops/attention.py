"""Paged attention over a mixed batch (prefill chunks and decodes together).

Layout of one step (three requests: a decode, a prefill chunk, a decode)::

    q (flat tokens)      | a | b0 b1 b2 b3 | c |        T = 6 query tokens
    query_start_loc      0   1             5   6      [B + 1]
    seq_lens             9   7                 30     [B]  context incl. this step
    query positions      8   3 4 5 6           29     seq_len - q_len + i

    k_cache[block, offset]: request r's token at position p lives in block
    block_tables[r, p // block_size] at offset p % block_size.

Each query token attends causally to every cached key at a position <= its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops import cpu_attention


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
    table: torch.Tensor  # [1, max_blocks]
    num_blocks: int
    mask: torch.Tensor  # [q_len, num_blocks * block_size] bool, causal from the cached context


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # query rows (one per request), int64
    tables: torch.Tensor  # [n, max_blocks]
    num_blocks: int
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size] bool: keys < seq_len


@dataclass
class _Plan:
    """What every layer of one step shares: the grouping, gather tables and masks. Built
    by the step's first layer, reused by the others: the key is the metadata's content
    (a few hundred integers), so a plan can never outlive the step it was built for."""

    seq_lens: list[int]
    starts: list[int]
    block_tables: torch.Tensor  # a copy
    prefills: list[_Prefill]
    decodes: list[_DecodeGroup]
    # Every decode at once, for the CPU kernel: query rows, block tables, lengths (int64).
    decode_rows: torch.Tensor
    decode_tables: torch.Tensor
    decode_lens: torch.Tensor

    def matches(self, lens: list[int], starts: list[int], block_tables: torch.Tensor) -> bool:
        return (lens == self.seq_lens and starts == self.starts
                and block_tables.shape == self.block_tables.shape
                and block_tables.dtype == self.block_tables.dtype
                and block_tables.device == self.block_tables.device
                and torch.equal(block_tables, self.block_tables))


_last_plan: _Plan | None = None


def _make_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
               lens: list[int], starts: list[int], block_size: int) -> _Plan:
    device = block_tables.device
    prefills: list[_Prefill] = []
    buckets: dict[int, list[int]] = {}  # log2 bucket of context length -> request indices
    for r, n in enumerate(lens):
        q_len = starts[r + 1] - starts[r]
        if q_len == 1:
            # Grouped by context length so that padding at most doubles the keys read.
            buckets.setdefault((n - 1).bit_length(), []).append(r)
            continue
        nblk = -(-n // block_size)
        # query row i sits at position n - q_len + i and sees keys 0..that position
        q_pos = torch.arange(n - q_len, n, device=device)
        mask = torch.arange(nblk * block_size, device=device)[None, :] <= q_pos[:, None]
        prefills.append(_Prefill(starts[r], starts[r + 1], block_tables[r : r + 1], nblk, mask))
    decodes = []
    all_decodes = sorted(r for reqs in buckets.values() for r in reqs)
    idx = torch.tensor(all_decodes, dtype=torch.long, device=device)
    decode_rows = query_start_loc.index_select(0, idx).long().contiguous()
    decode_tables = block_tables.index_select(0, idx).long().contiguous()
    decode_lens = seq_lens.index_select(0, idx).long().contiguous()
    for reqs in buckets.values():
        idx = torch.tensor(reqs, device=device)
        nblk = -(-max(lens[r] for r in reqs) // block_size)
        mask = torch.arange(nblk * block_size, device=device)[None, :] < seq_lens[idx].long()[:, None]
        decodes.append(_DecodeGroup(query_start_loc[idx].long(), block_tables.index_select(0, idx),
                                    nblk, mask[:, None, None, :]))
    return _Plan(lens, starts, block_tables.clone(), prefills, decodes,
                 decode_rows, decode_tables, decode_lens)


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
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]
    int32/64; seq_lens: [B]; query_start_loc: [B + 1]. Returns [T, Hq, D].

    The torch reference. Decodes (one query each) run as batched SDPA calls over
    their keys gathered by block table, grouped by context length (on the CPU in float32,
    one call of the C kernel instead, reading the cache in place); each prefill chunk
    runs alone with its causal mask offset by the context before it. Every layer of a
    step passes the same metadata tensors, so the grouping and masks are built by the
    first call and reused by the rest.
    """
    global _last_plan
    lens, starts = seq_lens.tolist(), query_start_loc.tolist()
    plan = _last_plan
    if plan is None or not plan.matches(lens, starts, block_tables):
        plan = _make_plan(block_tables, seq_lens, query_start_loc, lens, starts, k_cache.shape[1])
        _last_plan = plan
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    for p in plan.prefills:
        k = _gather(k_cache, p.table, p.num_blocks).to(q.dtype)
        v = _gather(v_cache, p.table, p.num_blocks).to(q.dtype)
        chunk = q[p.start : p.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        o = F.scaled_dot_product_attention(chunk, k, v, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
        out[p.start : p.end] = o[0].transpose(0, 1)
    if plan.decodes and cpu_attention.usable(q, k_cache):
        cpu_attention.decode(q, k_cache, v_cache, plan.decode_rows, plan.decode_tables,
                             plan.decode_lens, scale, out)
        return out
    for g in plan.decodes:
        k = _gather(k_cache, g.tables, g.num_blocks).to(q.dtype)
        v = _gather(v_cache, g.tables, g.num_blocks).to(q.dtype)
        o = F.scaled_dot_product_attention(q.index_select(0, g.rows)[:, :, None], k, v,
                                           attn_mask=g.mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, g.rows, o[:, :, 0])
    return out
