"""Paged attention over a mixed batch as one Triton launch (plus a merge for split-K).

Same contract as `paged_attention_ref` in ops/attention.py: flat varlen query
tokens, keys and values read through block tables, causal within each request,
and with a layer's sliding window w each query sees keys (position - w, position].

Work decomposition. The grid is (query tiles, KV heads, splits). A query tile
is BLOCK_Q consecutive query tokens of one request times the GROUP = Hq / Hkv
query heads that share one KV head, packed as rows of a single [BLOCK_M, D]
tile, so each K/V tile is loaded once per KV head and feeds tl.dot for every
row (decodes too: a decode tile is GROUP live rows padded to 16)::

    Q tile rows (GROUP = 3, BLOCK_Q = 5, BLOCK_M = 16)
    row m:    0  1  2 | 3  4  5 | ... | 12 13 14 | 15
    token:    t0 t0 t0| t1 t1 t1| ... | t4 t4 t4 | pad      token = tile_q0 + m // GROUP
    q head:   h0 h1 h2| h0 h1 h2| ... | h0 h1 h2 | pad      head = kv_head * GROUP + m % GROUP

Query tiles are numbered flat over the batch without a host sync: request r
owns tiles base(r) .. base(r) + cdiv(q_len_r, BLOCK_Q) - 1 with
base(r) = query_start_loc[r] // BLOCK_Q + r, which is strictly increasing and
never overlaps the next request's range, so T // BLOCK_Q + B tiles always
suffice and a program finds its request by binary search::

    query_start_loc   0     1              12    13        BLOCK_Q = 4
    q_len             1     11             1
    base(r)           0     0//4+1 = 1     12//4+2 = 5      (total 13//4 + 3 = 6)
    tiles             [0]   [1 2 3]  (4: idle)  [5]

When every request fits one tile (max_query_len <= BLOCK_Q, e.g. pure decode)
tile index = request index and the grid is just B.

Split-K. Each tile's key range [0, kv_end) is cut into NUM_SPLITS partitions
of whole BLOCK_N chunks; split s writes its normalised partial output and
base-2 log-sum-exp (-inf for rows that saw no key, or for a partition that
starts past kv_end, whose program exits after that store). A second kernel
merges the splits per (token, head), giving -inf partitions zero weight::

    kv_end = 300, BLOCK_N = 64, NUM_SPLITS = 4 -> 5 chunks, 2 per split
    split 0: [0, 128)  split 1: [128, 256)  split 2: [256, 300)  split 3: empty

Sliding window. A tile's key range starts at the BLOCK_N chunk holding its first
live query's first key (position - w + 1), not at 0, so a windowed layer's cost
stops growing with the context; splits share that range. Chunks below the last
live query's first key take the masked path as the diagonal does::

    first query at 300, last at 303, w = 100, BLOCK_N = 64
    keys [192, 256): masked (rows' windows start at 201 .. 204)
    keys [256, 300): unmasked     keys [300, 304): masked (the diagonal)

Everything the grid and the compiled variants depend on is a tensor shape or
a python int argument, so the launch is CUDA-graph safe; for capture pass
max_query_len = 1 and max_seq_len = max_model_len.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from ops.attention import StepPlan

_LOG2E = 1.4426950408889634
# The window of a global layer: larger than any position (the mask's q_pos - window stays
# in int32), so its tiles start at key 0 and every key passes the window's test.
_NO_WINDOW = 1 << 30


@triton.jit
def _attend_chunk(
    acc, l_i, m_i, q, q_pos,
    k_ptr, v_ptr, bt_row, start, kv_first, kv_hi, window, kv_head, scale_log2,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    k_scale, v_scale, softcap_log2,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N). MASKED applies
    the causal and window masks and loads only keys in [kv_first, kv_hi); without it
    every key is visible to every row."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # BLOCK_N positions span several pages: gather each row's page via the table.
    if MASKED:
        n_ok = (offs_n < kv_hi) & (offs_n >= kv_first)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k_ptrs = k_ptr + (page * stride_kb + in_page * stride_ks + kv_head * stride_kh)[:, None] \
        + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + (page * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None] \
        + offs_d[None, :] * stride_vd
    if MASKED:
        # Out-of-range keys load zeros: stale cache bytes may hold NaN/inf, and 0 * NaN
        # would poison P @ V.
        k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    if KV_FP8:  # the cache holds k / k_scale (ops.attention.read_cache)
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if SOFTCAP:  # c tanh(x / c) in the log2 domain is c' tanh(s / c'), c' = c log2(e); tanh by exp
        s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))
    if MASKED:
        seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    if KV_FP8:
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, part_ptr, lse_ptr,
    num_seqs, scale_log2, window, k_scale, v_scale, softcap_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SINGLE_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if SINGLE_TILE:
        req = tile
        tile_q0 = 0
    else:
        # Largest r with base(r) = qsl[r] // BLOCK_Q + r <= tile (see module docstring).
        lo = tl.zeros([], dtype=tl.int32)
        hi = tl.zeros([], dtype=tl.int32) + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            base = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            take = base <= tile
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        req = lo
        tile_q0 = (tile - (tl.load(qsl_ptr + req).to(tl.int32) // BLOCK_Q + req)) * BLOCK_Q

    q_start = tl.load(qsl_ptr + req).to(tl.int32)
    q_len = tl.load(qsl_ptr + req + 1).to(tl.int32) - q_start
    if tile_q0 >= q_len:
        return  # a spare tile of the flat upper bound: it owns no query token
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    ctx = seq_len - q_len  # keys cached before this step's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = tile_q0 + offs_m // GROUP  # query index within the request
    row_ok = (offs_m < BLOCK_Q * GROUP) & (qi < q_len)
    token = q_start + qi
    head = kv_head * GROUP + offs_m % GROUP
    q_pos = ctx + qi
    first_pos = ctx + tile_q0  # the tile's first and last live queries
    # The tile's last live query sees keys up to kv_end - 1; its first, keys from kv_first
    # (0 without a window: `window` is then larger than any position).
    kv_end = ctx + tl.minimum(tile_q0 + BLOCK_Q, q_len)
    kv_first = tl.maximum(first_pos - window + 1, 0)
    kv_start = kv_first // BLOCK_N * BLOCK_N
    # Keys from kv_all on are in every live query's window.
    kv_all = tl.maximum(kv_end - window, 0)

    if NUM_SPLITS == 1:
        kv_lo = kv_start
        kv_hi = kv_end
    else:
        chunks_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), NUM_SPLITS)
        kv_lo = kv_start + split * chunks_per_split * BLOCK_N
        kv_hi = tl.minimum(kv_lo + chunks_per_split * BLOCK_N, kv_end)
        if kv_lo >= kv_hi:
            # Past this request's context: tell the merge to skip this split.
            tl.store(lse_ptr + split * stride_ls + token * stride_lt + head,
                     tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    # Keys at or above kv_all and up to the first live query's position are visible to
    # every row: those whole chunks skip the masks; the rest (below kv_all, where the
    # rows' windows begin; the diagonal and the ragged end) take the masked path.
    #   kv_lo ...... head_end ........ full_end ......... kv_hi
    #   | masked chunks |  unmasked chunks  |  masked chunks  |
    head_end = tl.minimum(kv_lo + tl.cdiv(tl.maximum(kv_all - kv_lo, 0), BLOCK_N) * BLOCK_N, kv_hi)
    full_end = kv_lo + (tl.minimum(kv_hi, first_pos + 1) - kv_lo) // BLOCK_N * BLOCK_N
    full_end = tl.maximum(full_end, head_end)
    for start in range(kv_lo, head_end, BLOCK_N):
        acc, l_i, m_i = _attend_chunk(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, bt_row, start, kv_first, kv_hi, window, kv_head, scale_log2,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            k_scale, v_scale, softcap_log2, BLOCK_N, HEAD_DIM, PAGE_SIZE, True, DOT_PRECISION, KV_FP8, SOFTCAP)
    for start in range(head_end, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_chunk(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, bt_row, start, kv_first, kv_hi, window, kv_head, scale_log2,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            k_scale, v_scale, softcap_log2, BLOCK_N, HEAD_DIM, PAGE_SIZE, False, DOT_PRECISION, KV_FP8, SOFTCAP)
    for start in range(full_end, kv_hi, BLOCK_N):
        acc, l_i, m_i = _attend_chunk(
            acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, bt_row, start, kv_first, kv_hi, window, kv_head, scale_log2,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
            k_scale, v_scale, softcap_log2, BLOCK_N, HEAD_DIM, PAGE_SIZE, True, DOT_PRECISION, KV_FP8, SOFTCAP)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(part_ptr + split * stride_ps + token[:, None] * stride_pt
                 + head[:, None] * stride_ph + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    num_heads,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h < num_heads
    lse_row = lse_ptr + token * stride_lt + offs_h

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_row + s * stride_ls, mask=h_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)

    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(lse_row + s * stride_ls, mask=h_ok, other=float("-inf"))
        live = lse > float("-inf")
        w = tl.exp2(lse - m)  # 0 for a split that saw nothing
        # Skip the partial output of an empty split entirely: it was never written.
        part = tl.load(part_ptr + s * stride_ps + token * stride_pt + offs_h[:, None] * stride_ph
                       + offs_d[None, :], mask=(h_ok & live)[:, None], other=0.0)
        acc += w[:, None] * part
        denom += w
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number keeps the heuristic testable
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_programs: int, max_seq_len: int, sm_count: int,
                       min_partition: int = 256, max_splits: int = 16) -> int:
    """Splits per query tile so that a launch too small for the GPU fills it.

    num_programs is the grid without splitting (query tiles x KV heads). Once
    that covers every SM, splitting only adds merge traffic (measured on an
    H100: decode at 64 x 8 programs is fastest unsplit). Below that we aim for
    about two programs per SM, with no partition shorter than `min_partition`
    keys and at most `max_splits` (32 splits measured slower than 16).
    """
    if num_programs >= sm_count:
        return 1
    by_length = max(1, max_seq_len // min_partition)
    return max(1, min(triton.cdiv(2 * sm_count, num_programs), by_length, max_splits))


def paged_attention_triton(
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
    *,
    block_n: int | None = None,
    block_m: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (any strides); caches: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32/64; seq_lens: [B]; query_start_loc:
    [B + 1] (int32/64). Returns a new contiguous [T, Hq, D] in q's dtype.

    max_query_len and max_seq_len must bound the batch (they pick the tile
    shape and the split count; they are never checked on the device). `plan`
    (the torch and C paths' per-step plan) is not used: the kernel reads the
    metadata on the device. `window`: the layer's sliding window (None: global);
    each query tile reads the keys from its first query's window on. An fp8 cache
    (--kv-cache-dtype fp8) holds k / k_scale and v / v_scale: each tile is read as
    fp8 -> float32, times its scale, -> q's dtype. `softcap`: the scaled scores soft-capped,
    softcap tanh(s / softcap) (Gemma 2), before the masks, as transformers does.

    Tunables (defaults measured on an H100, Llama-3-8B heads, bf16):
    - block_n: keys per inner step, several pages gathered through the table;
      128 when every request fits one Q tile (decode batches), else 64.
    - block_m: Q tile rows when queries have many tokens (64). A decode-only
      batch takes the smallest tile that holds one GQA group, at least 16
      rows for tl.dot.
    - num_warps: 4, or 8 for 128-row tiles.
    - num_stages: software pipelining depth; 2 with one tile per request, else 3.
    - num_splits: forces split-K; None picks `default_num_splits`.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert page_size & (page_size - 1) == 0, "block_size must be a power of two"
    assert block_m >= 16 and block_m & (block_m - 1) == 0
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] == num_seqs
    group = num_heads // num_kv_heads

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    # Rows = query tokens x GQA group; no larger than the longest query needs.
    rows = triton.next_power_of_2(max(1, max_query_len) * group)
    tile_m = max(16, triton.next_power_of_2(group), min(block_m, rows))
    block_q = tile_m // group
    single_tile = max_query_len <= block_q
    num_tiles = num_seqs if single_tile else num_tokens // block_q + num_seqs

    # A window bounds the keys a tile reads (its first query's window to its last query).
    span = max_seq_len if window is None else min(max_seq_len, window + max(1, max_query_len))
    if num_splits is None:
        num_splits = default_num_splits(num_tiles * num_kv_heads, span, _sm_count(q.device))
    assert num_splits >= 1
    # Measured on an H100 (Llama-3-8B heads, bf16): decode-only launches stream best with
    # long, double-buffered steps; prefill tiles prefer 64-key steps, triple-buffered.
    if block_n is None:
        block_n = 128 if single_tile else 64
    if num_stages is None:
        num_stages = 2 if single_tile else 3
    assert block_n >= 16 and block_n & (block_n - 1) == 0
    if num_warps is None:
        num_warps = 8 if tile_m >= 128 else 4
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs

    if num_splits > 1:  # split-K scratch: partial outputs and their log-sum-exps, contiguous
        part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32,
                           device=q.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    else:  # one split writes `out` directly and never touches these
        part, lse, part_strides, lse_strides = out, out, (0, 0, 0), (0, 0)

    _paged_attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, part, lse,
        num_seqs, scale * _LOG2E, _NO_WINDOW if window is None else window, float(k_scale), float(v_scale),
        float(softcap or 0.0) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *part_strides,
        *lse_strides,
        GROUP=group,
        BLOCK_M=tile_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        SINGLE_TILE=single_tile,
        DOT_PRECISION=precision,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        SOFTCAP=bool(softcap),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        block_h = min(16, triton.next_power_of_2(num_heads))
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            part, lse, out,
            num_heads,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_H=block_h,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
