"""Triton kernel: rotate-half RoPE of q and k fused with the paged KV-cache write.

Same contract as `ops.rotary.rotary_kv_write_ref`, in one launch, except that q
and k are rotated IN PLACE: the tensors passed in are overwritten and returned.
In the model they are views of the fused qkv projection output, so the rotation
lands straight in that buffer and nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.scaled_linear_triton import _round_fp8_e4m3

# Elements of one (heads x half head_dim) tile; keeps registers per program modest.
_TILE = 512


@triton.jit
def _rope_tile(
    x_ptr,
    x_base,
    stride_h,
    stride_d,
    h,
    cos,
    sin,
    mask,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate one tile of heads in place; return the two rotated halves (x's dtype)."""
    ds = tl.arange(0, BLOCK_HALF)
    p1 = x_ptr + x_base + h[:, None] * stride_h + ds[None, :] * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(p1, y1, mask=mask)
    tl.store(p2, y2, mask=mask)
    return y1, y2


@triton.jit
def _to_cache(x, scale, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache holds it (ops.rotary.to_cache): fp8 holds x / scale, saturated to
    +-448 and rounded half to even (first onto e4m3's grid: see _round_fp8_e4m3)."""
    if KV_FP8:
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
        return _round_fp8_e4m3(y).to(cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cs_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    q_st,
    q_sh,
    q_sd,
    k_st,
    k_sh,
    k_sd,
    v_st,
    v_sh,
    v_sd,
    cs_stride,
    kc_sb,
    kc_so,
    kc_sh,
    kc_sd,
    vc_sb,
    vc_so,
    vc_sh,
    vc_sd,
    num_q_heads,
    num_kv_heads,
    block_size,
    k_scale,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Axis 0: token. Axis 1: a tile of q heads, or (past the q tiles) a tile of
    # kv heads whose k is rotated and whose k and v go to the cache.
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n_q_tiles = tl.cdiv(num_q_heads, BLOCK_H)

    ds = tl.arange(0, BLOCK_HALF)
    d_ok = ds < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs_row = cs_ptr + pos * cs_stride + ds
    cos = tl.load(cs_row, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    hs = tl.arange(0, BLOCK_H)

    if tile < n_q_tiles:
        h = tile * BLOCK_H + hs
        mask = (h < num_q_heads)[:, None] & d_ok[None, :]
        _rope_tile(q_ptr, t * q_st, q_sh, q_sd, h, cos, sin, mask, HALF, BLOCK_HALF)
    else:
        h = (tile - n_q_tiles) * BLOCK_H + hs
        mask = (h < num_kv_heads)[:, None] & d_ok[None, :]
        y1, y2 = _rope_tile(k_ptr, t * k_st, k_sh, k_sd, h, cos, sin, mask, HALF, BLOCK_HALF)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # Padded rows of a captured batch carry slot -1: rotate, but never write.
        if slot >= 0:
            blk = slot // block_size
            off = slot % block_size
            kc = kc_ptr + blk * kc_sb + off * kc_so + h[:, None] * kc_sh + ds[None, :] * kc_sd
            tl.store(kc, _to_cache(y1, k_scale, kc_ptr, KV_FP8), mask=mask)
            tl.store(kc + HALF * kc_sd, _to_cache(y2, k_scale, kc_ptr, KV_FP8), mask=mask)
            if 2 * HALF == HEAD_D:
                # v is copied as two halves too, so one tile shape serves the whole program.
                vp = v_ptr + t * v_st + h[:, None] * v_sh + ds[None, :] * v_sd
                vc = vc_ptr + blk * vc_sb + off * vc_so + h[:, None] * vc_sh + ds[None, :] * vc_sd
                v1 = tl.load(vp, mask=mask, other=0.0)
                v2 = tl.load(vp + HALF * v_sd, mask=mask, other=0.0)
                tl.store(vc, _to_cache(v1, v_scale, vc_ptr, KV_FP8), mask=mask)
                tl.store(vc + HALF * vc_sd, _to_cache(v2, v_scale, vc_ptr, KV_FP8), mask=mask)
            else:
                # Partial rotary: k's dimensions past the rotating ones, as given, and v whole.
                dd = tl.arange(0, BLOCK_D)
                h_ok = (h < num_kv_heads)[:, None]
                tail = h_ok & ((dd >= 2 * HALF) & (dd < HEAD_D))[None, :]
                kp = k_ptr + t * k_st + h[:, None] * k_sh + dd[None, :] * k_sd
                kt = kc_ptr + blk * kc_sb + off * kc_so + h[:, None] * kc_sh + dd[None, :] * kc_sd
                tl.store(kt, _to_cache(tl.load(kp, mask=tail, other=0.0), k_scale, kc_ptr, KV_FP8), mask=tail)
                whole = h_ok & (dd < HEAD_D)[None, :]
                vp = v_ptr + t * v_st + h[:, None] * v_sh + dd[None, :] * v_sd
                vc = vc_ptr + blk * vc_sb + off * vc_so + h[:, None] * vc_sh + dd[None, :] * vc_sd
                tl.store(vc, _to_cache(tl.load(vp, mask=whole, other=0.0), v_scale, vc_ptr, KV_FP8), mask=whole)


def rotary_kv_write_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k IN PLACE, scatter k (rotated) and v into the paged caches (an fp8
    cache: k / k_scale and v / v_scale, as `ops.rotary.to_cache`).

    q: [T, Hq, D]; k, v: [T, Hkv, D], any strides (views of a fused qkv output
    are the intended case); positions, slot_mapping: [T] integer; cos_sin:
    [max_pos, R] (cos | sin, any float dtype, read as float32; R <= D even: the first R
    dimensions rotate, the rest pass through, partial rotary); caches:
    [num_blocks, block_size, Hkv, D]. A slot < 0 writes nothing. The rotation is
    computed in float32 and rounded once to q's dtype, then to the cache dtype.
    Returns (q, k), the very tensors given, now rotated. One launch, grid
    (T, ceil(Hq / BLOCK_H) + ceil(Hkv / BLOCK_H)); no host synchronisation, so it
    can be captured in a CUDA graph.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if d % 2 or k.shape != (t, hkv, d) or v.shape != (t, hkv, d):
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    if t == 0:
        return q, k
    # The kernel indexes these with unit stride; in the model they already are.
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    if cos_sin.stride(1) != 1:
        cos_sin = cos_sin.contiguous()
    rot = cos_sin.shape[1]
    if rot % 2 or rot > d:
        raise ValueError(f"rotary table of width {rot} for head_dim {d}")
    half = rot // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(hq, hkv)), max(1, _TILE // block_half))
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _rotary_kv_write_kernel[grid](
        q,
        k,
        v,
        positions,
        cos_sin,
        k_cache,
        v_cache,
        slot_mapping,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        cos_sin.stride(0),
        *k_cache.stride(),
        *v_cache.stride(),
        hq,
        hkv,
        k_cache.shape[1],
        float(k_scale),
        float(v_scale),
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        HEAD_D=d,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=4,
    )
    return q, k
