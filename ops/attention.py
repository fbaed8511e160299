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

    The torch reference: gather each request's keys by its block table into a
    padded [B, L, ...] tensor and run one masked SDPA with grouped-query heads.
    """
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    nblk = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :nblk].long()
    k = k_cache[blocks].reshape(batch, nblk * block_size, num_kv_heads, head_dim)
    v = v_cache[blocks].reshape(batch, nblk * block_size, num_kv_heads, head_dim)

    seq_lens = seq_lens.long()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    # token t belongs to request req_of[t], at row t - query_start_loc[req] of its chunk
    req_of = torch.repeat_interleave(torch.arange(batch, device=q.device), q_lens)
    row_of = torch.arange(num_tokens, device=q.device) - query_start_loc[:-1].long()[req_of]

    if max_query_len == 1:  # pure decode: no padding of queries needed
        qp = q.view(batch, 1, num_heads, head_dim)
    else:
        qp = q.new_zeros(batch, max_query_len, num_heads, head_dim)
        qp[req_of, row_of] = q
    # Padded rows get positions past the end, so they still see >= 1 key (no NaN).
    rows = torch.arange(max_query_len, device=q.device)
    q_pos = (seq_lens - q_lens)[:, None] + rows[None, :]  # [B, Qmax]
    keys = torch.arange(nblk * block_size, device=q.device)
    mask = (keys[None, None, :] <= q_pos[:, :, None]) & (keys[None, None, :] < seq_lens[:, None, None])

    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)  # [B, Qmax, Hq, D]
    if max_query_len == 1:
        return out.reshape(num_tokens, num_heads, head_dim)
    return out[req_of, row_of]
