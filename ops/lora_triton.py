"""Triton kernels: the batched LoRA delta of ops/lora.py (`lora_add_ref`), segmented as
Punica's SGMV: shrink, then expand per output slice, each one launch over (segment, block
of the segment's rows[, block of output columns]).

    shrink   grid (S, cdiv(L, BL)):            h[s, l, :n*r] = x[rows[s, l]] @ a[slot(s)].T
    expand   grid (S, cdiv(L, BL), cdiv(out_i, BN)), once per slice i:
             y[rows[s, l], off_i + c] += h[s, l, i*r : (i+1)*r] @ b_i[slot(s), c].T

A token is in one segment only, so every y element has one writer (load, add, store; no
atomics); padding rows (index T) are masked out. Products in float32, y rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ops.lora import LoraRows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, rows_ptr, slots_ptr, T, K, R, L,
                   x_stride, a_stride_s, a_stride_r, h_stride_s, h_stride_l,
                   HAS_SLOTS: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    s = tl.program_id(0)
    ls = tl.program_id(1) * BL + tl.arange(0, BL)
    rows = tl.load(rows_ptr + s * L + ls, mask=ls < L, other=T)
    valid = rows < T
    slot = tl.load(slots_ptr + s).to(tl.int64) if HAS_SLOTS else s.to(tl.int64)
    rs = tl.arange(0, BR)
    acc = tl.zeros((BL, BR), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + ks[None, :],
                     mask=valid[:, None] & (ks[None, :] < K), other=0.0).to(tl.float32)
        ak = tl.load(a_ptr + slot * a_stride_s + rs[None, :] * a_stride_r + ks[:, None],
                     mask=(rs[None, :] < R) & (ks[:, None] < K), other=0.0).to(tl.float32)
        acc += tl.dot(xk, ak, input_precision=DOT_PRECISION)
    tl.store(h_ptr + s * h_stride_s + ls[:, None] * h_stride_l + rs[None, :], acc,
             mask=(ls[:, None] < L) & (rs[None, :] < R))


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, rows_ptr, slots_ptr, T, N, r, L, h_off, y_off,
                   h_stride_s, h_stride_l, b_stride_s, b_stride_n, y_stride,
                   HAS_SLOTS: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    s = tl.program_id(0)
    ls = tl.program_id(1) * BL + tl.arange(0, BL)
    ns = tl.program_id(2) * BN + tl.arange(0, BN)
    rows = tl.load(rows_ptr + s * L + ls, mask=ls < L, other=T)
    valid = rows < T
    slot = tl.load(slots_ptr + s).to(tl.int64) if HAS_SLOTS else s.to(tl.int64)
    rs = tl.arange(0, BR)
    h = tl.load(h_ptr + s * h_stride_s + ls[:, None] * h_stride_l + h_off + rs[None, :],
                mask=(ls[:, None] < L) & (rs[None, :] < r), other=0.0)
    b = tl.load(b_ptr + slot * b_stride_s + ns[None, :] * b_stride_n + rs[:, None],
                mask=(ns[None, :] < N) & (rs[:, None] < r), other=0.0).to(tl.float32)
    delta = tl.dot(h, b, input_precision=DOT_PRECISION)
    mask = valid[:, None] & (ns[None, :] < N)
    ptrs = y_ptr + rows[:, None].to(tl.int64) * y_stride + y_off + ns[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
                    rows: LoraRows) -> torch.Tensor:
    """`lora_add_ref`'s contract, in two kinds of launches (see the module docstring)."""
    assert y.stride(-1) == 1 and x.stride(-1) == 1 and a.is_contiguous()
    t, k = x.shape
    s, length = rows.gather_rows.shape
    n_r = a.shape[1]
    r = bs[0].shape[2]
    gather = rows.gather_rows.contiguous()
    slots = rows.slots if rows.slots is not None else gather  # unused without HAS_SLOTS
    has_slots = rows.slots is not None
    # Products in float32 (the 16-bit inputs are upcast): exact ieee, not tf32, on a GPU.
    precision = "ieee"
    h = torch.empty(s, length, n_r, dtype=torch.float32, device=x.device)
    bl = 16
    br = max(16, triton.next_power_of_2(n_r))
    _shrink_kernel[(s, triton.cdiv(length, bl))](
        x, a, h, gather, slots, t, k, n_r, length, x.stride(0), a.stride(0), a.stride(1),
        h.stride(0), h.stride(1), HAS_SLOTS=has_slots, BL=bl, BR=br, BK=64,
        DOT_PRECISION=precision)
    off = 0
    br = max(16, triton.next_power_of_2(r))
    for i, b in enumerate(bs):
        assert b.is_contiguous()
        n = b.shape[1]
        bn = min(128, max(16, triton.next_power_of_2(n)))
        _expand_kernel[(s, triton.cdiv(length, bl), triton.cdiv(n, bn))](
            h, b, y, gather, slots, t, n, r, length, i * r, off, h.stride(0), h.stride(1),
            b.stride(0), b.stride(1), y.stride(0), HAS_SLOTS=has_slots, BL=bl, BN=bn, BR=br,
            DOT_PRECISION=precision)
        off += n
    return y
