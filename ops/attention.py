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

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """[n, max_blocks] tables -> [n, Hkv, L, D] for the first `length` positions (L rounded up to a block)."""
    block_size = cache.shape[1]
    nblk = (length + block_size - 1) // block_size
    g = cache[tables[:, :nblk].long()]  # [n, nblk, bs, Hkv, D]
    return g.reshape(g.shape[0], nblk * block_size, *cache.shape[2:]).transpose(1, 2)


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
    their keys gathered by block table, grouped by context length so that padding
    at most doubles the keys read; each prefill chunk runs alone with its causal
    mask offset by the context before it.
    """
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_cache.shape[2]
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decodes: dict[int, list[int]] = {}  # log2 bucket of context length -> request indices
    for r, n in enumerate(lens):
        q_len = starts[r + 1] - starts[r]
        if q_len == 1:
            decodes.setdefault((n - 1).bit_length(), []).append(r)
            continue
        k = _gather(k_cache, block_tables[r : r + 1], n)
        v = _gather(v_cache, block_tables[r : r + 1], n)
        # query row i sits at position n - q_len + i and sees keys 0..that position
        q_pos = torch.arange(n - q_len, n, device=q.device)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
        chunk = q[starts[r] : starts[r + 1]].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        o = F.scaled_dot_product_attention(chunk, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=gqa)
        out[starts[r] : starts[r + 1]] = o[0].transpose(0, 1)
    for rows in decodes.values():
        idx = torch.tensor(rows, device=q.device)
        longest = max(lens[r] for r in rows)
        k = _gather(k_cache, block_tables[idx], longest)
        v = _gather(v_cache, block_tables[idx], longest)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[idx].long()[:, None]
        token_idx = query_start_loc[idx].long()
        o = F.scaled_dot_product_attention(q[token_idx][:, :, None], k.to(q.dtype), v.to(q.dtype),
                                           attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
        out[token_idx] = o[:, :, 0]
    return out
