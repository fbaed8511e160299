"""Triton kernels for linears over pre-quantized weights (ops/scaled_linear.py's layouts).

Same contract as `scaled_linear_ref`. Three kernels, learnt from vLLM's pure-Triton ones
(`_w8a8_triton_block_scaled_mm`, `triton_scaled_mm`, the AWQ/GPTQ Triton GEMMs):

- `_quantize_act_kernel`: dynamic activation quantization, one program per (row, group):
  the group's amax, scale = amax / 448 (fp8) or / 127 (int8), q = x / scale rounded.
- `_w8a8_kernel`: fp8 x fp8 or int8 x int8 tiles through tl.dot (float32 / int32
  accumulators). Scales that change along K (per-group activations, block weights) are
  applied per BLOCK_K step, which lies inside one group and one block; the others once at
  the end (an int8 product is then an exact integer sum)::

      acc += dot(a_q[:, kb], w_q[kb, :]) * a_s[:, g(kb)] * w_s[block(n), b(kb)]   (in the loop)
      y = acc * a_s[:, None] * w_s[None, :]                                        (at the end)

- `_w16_kernel`: weight-only, the quantized weight dequantized inside the GEMM: a tile of
  int4 nibbles (each int32 word read for its 8 inputs) or of 8-bit quants becomes
  (u - zero) * scale in float32, rounded to the activations' dtype, into tl.dot.

Every launch's tile sizes depend on N and K only (BLOCK_M is 16 rows for every batch), and
each row's sum over K runs in the same BLOCK_K order whatever its batch: no split-K, so a
row's result does not depend on its batch. Nothing
reads back to the host: the launches are CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.scaled_linear import FP8_MAX, INT8_MAX, SCALE_EPS, ScaledWeight

_GROUP_M = 8  # output tiles of 8 row blocks share their weight columns in L2


_RNE = 12582912.0  # 1.5 * 2**23: (v + _RNE) - _RNE rounds a float32 |v| < 2**22 half to even


@triton.jit
def _round_fp8_e4m3(y):
    """y (float32, |y| <= 448) rounded half to even to float8_e4m3fn's grid, still float32:
    3 mantissa bits, subnormals below 2**-6 (a spacing of 2**-9). The cast of the result to
    fp8 is then exact; Triton's interpreter rounds a direct cast wrongly where the rounding
    carries into the exponent (126.1 -> 64), so the kernel rounds first, on the GPU too."""
    bits = y.to(tl.int32, bitcast=True)
    ulp_exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3  # the grid's spacing at |y|: 2**ulp_exp
    down = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)  # 2**-ulp_exp
    up = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * down + _RNE) - _RNE) * up
    return tl.where(bits < 0, -r, r)  # the sign as it was (-0.0 for what rounds to zero)


@triton.jit
def _quantize_act_kernel(x_ptr, q_ptr, s_ptr, stride_xm, stride_qm, stride_sm, ub,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr,
                         EPS: tl.constexpr, IS_FP8: tl.constexpr, HAS_UB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    base = g * GROUP
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, GROUP, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + base + cols, mask=cols < GROUP, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, 0)
    if HAS_UB:
        top = tl.minimum(top, ub)
    scale = tl.maximum(top, EPS) / QMAX
    tl.store(s_ptr + row * stride_sm + g, scale)
    for off in range(0, GROUP, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < GROUP
        x = tl.load(x_ptr + row * stride_xm + base + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale)  # IEEE division, as torch's
        if IS_FP8:
            q = _round_fp8_e4m3(tl.clamp(y, -QMAX, QMAX)).to(q_ptr.dtype.element_ty)
        else:  # half to even, as torch.round and vLLM's int8 quantization
            q = tl.clamp((y + _RNE) - _RNE, -QMAX, QMAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * stride_qm + base + cols, q, mask=mask)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows and columns (and which exist), its (row block, column
    block) grouped so neighbours share columns."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                 stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                 A_GROUP: tl.constexpr, B_BLOCK_N: tl.constexpr, B_BLOCK_K: tl.constexpr,
                 IN_LOOP: tl.constexpr, IS_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    if IS_INT and not IN_LOOP:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IS_INT:
            d = tl.dot(a, b, out_dtype=tl.int32)
        else:
            d = tl.dot(a, b)
        if IN_LOOP:
            d = d.to(tl.float32)
            if A_GROUP > 0:
                sa = tl.load(as_ptr + offs_m * stride_asm + k0 // A_GROUP, mask=m_ok, other=0.0)
                d = d * sa[:, None]
            if B_BLOCK_K > 0:
                sb = tl.load(bs_ptr + (offs_n // B_BLOCK_N) * stride_bsn + k0 // B_BLOCK_K, mask=n_ok, other=0.0)
                d = d * sb[None, :]
            acc += d
        else:
            acc += d
    out = acc.to(tl.float32)
    if A_GROUP == 0:
        out = out * tl.load(as_ptr + offs_m * stride_asm, mask=m_ok, other=0.0)[:, None]
    if B_BLOCK_K == 0:
        out = out * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             out.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w16_kernel(a_ptr, b_ptr, s_ptr, z_ptr, bias_ptr, c_ptr, M, N, K,
                stride_am, stride_bn, stride_sn, stride_zn, stride_cm,
                INT4: tl.constexpr, GROUP: tl.constexpr, S_BLOCK_N: tl.constexpr, S_BLOCK_K: tl.constexpr,
                HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """INT4: b [N, K/8] int32, scales/zeros [N, K/GROUP]. 8-bit: b [N, K], scales [N]
    (S_BLOCK_K = 0) or [N/S_BLOCK_N, K/S_BLOCK_K]."""
    offs_m, offs_n, m_ok, n_ok = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if not INT4 and S_BLOCK_K == 0:
        s_col = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if INT4:
            # Each word holds 8 consecutive inputs: read it for each (L1 serves the repeats).
            packed = tl.load(b_cols + (k // 8)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            u = ((packed >> ((k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
            g = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0)
            if HAS_ZERO:
                z = tl.load(z_ptr + offs_n * stride_zn + g, mask=n_ok, other=0).to(tl.float32)
                w = (u - z[None, :]) * s[None, :]
            else:
                w = (u - 8.0) * s[None, :]
        else:
            q = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
            if S_BLOCK_K == 0:
                w = q * s_col[None, :]
            else:
                s = tl.load(s_ptr + (offs_n // S_BLOCK_N) * stride_sn + k0 // S_BLOCK_K, mask=n_ok, other=0.0)
                w = q * s[None, :]
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Rows per tile, for every batch: a tile of another height may take another MMA instruction
# (Hopper's wgmma from 64 rows, mma.sync below), whose sums need not round alike, and then a
# decode row's result would depend on the prefill rows beside it. 16 is tl.dot's least; what
# it costs prefill against 64-row tiles is benchmarks/quantized_gpu.py --block-m's to measure.
BLOCK_M = 16


def quantize_activations_triton(x: torch.Tensor, w: ScaledWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous rows) -> (q [M, K], scales [M, groups] float32), as
    `quantize_activations`."""
    m, k = x.shape
    group = w.act_group if w.act == "group" else k
    is_fp8 = w.kind == "fp8"
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    s = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    top = FP8_MAX if is_fp8 else INT8_MAX
    if m:
        _quantize_act_kernel[(m, k // group)](
            x, q, s, x.stride(0), q.stride(0), s.stride(0),
            float(w.act_scale_ub) if w.act_scale_ub is not None else 0.0,
            GROUP=group, BLOCK=min(1024, triton.next_power_of_2(group)), QMAX=top, EPS=SCALE_EPS * top,
            IS_FP8=is_fp8, HAS_UB=w.act_scale_ub is not None, num_warps=4)
    return q, s


def scaled_linear_triton(x: torch.Tensor, w: ScaledWeight, bias: torch.Tensor | None = None, *,
                         block_m: int = BLOCK_M, block_n: int | None = None,
                         block_k: int | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K] on the weight's device; returns x's dtype. The
    tunables are for benchmarks: other tiles than the defaults give other bits."""
    n, k = w.shape
    shape = x.shape
    assert shape[-1] == k, (shape, w.shape)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*shape[:-1], n)
    bm = block_m
    bn = block_n or (64 if n >= 2048 else 32)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    if w.act is None:
        int4 = w.kind == "int4"
        if int4:
            bk = block_k or min(64, w.group_size)
            assert w.group_size % bk == 0
            s_bn, s_bk = 0, 0
        else:
            s_bn, s_bk = w.block if w.block is not None else (0, 0)
            bk = block_k or min(64, s_bk or 64)
            assert s_bk == 0 or s_bk % bk == 0
        zero = w.zero if w.zero is not None else w.scale
        _w16_kernel[grid](
            x2, w.qweight, w.scale, zero, bias_arg, out, m, n, k,
            x2.stride(0), w.qweight.stride(0), w.scale.stride(0), zero.stride(0), out.stride(0),
            INT4=int4, GROUP=max(w.group_size, 1), S_BLOCK_N=max(s_bn, 1), S_BLOCK_K=s_bk,
            HAS_ZERO=w.zero is not None, HAS_BIAS=has_bias,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M, num_warps=4, num_stages=3)
        return out.reshape(*shape[:-1], n)
    q, s = quantize_activations_triton(x2, w)
    a_group = w.act_group if w.act == "group" else 0
    b_bn, b_bk = w.block if w.block is not None else (1, 0)
    steps = [g for g in (a_group, b_bk) if g]
    bk = block_k or min([128, *steps])
    assert all(g % bk == 0 for g in steps), (bk, steps)
    _w8a8_kernel[grid](
        q, s, w.qweight, w.scale, bias_arg, out, m, n, k,
        q.stride(0), s.stride(0), w.qweight.stride(0), w.scale.stride(0) if w.scale.dim() == 2 else 1,
        out.stride(0),
        A_GROUP=a_group, B_BLOCK_N=b_bn, B_BLOCK_K=b_bk, IN_LOOP=bool(steps), IS_INT=w.kind == "int8", HAS_BIAS=has_bias,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M, num_warps=4, num_stages=3)
    return out.reshape(*shape[:-1], n)
