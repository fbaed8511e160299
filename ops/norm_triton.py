"""Triton kernel: RMSNorm fused with the residual add before it (one launch per call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    r_stride,
    out_stride,
    res_out_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole row sits in registers (hidden <= BLOCK).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
        # The sum is rounded to the residual stream's dtype before it is normalised,
        # exactly as the eager `x + residual` is.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
    else:
        s = x
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / n_cols + eps)
    # Round the normalised row to the input dtype before the weight multiply, as
    # the reference (and Hugging Face) do.
    normed = (sf * rstd).to(s.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norm(x + residual) * weight, x + residual), as `ops.norm.rms_norm_ref`.

    x, residual: [..., hidden]; weight: [hidden]. The sum is kept in the input
    dtype, the normalisation runs in float32, and the output dtype is that of
    `weight * x` (type promotion, as in the reference). With no residual the
    second value is x itself. `out` / `residual_out` optionally receive the
    results (preallocated, e.g. static CUDA-graph buffers; must be contiguous).
    One launch, grid (rows,), one program per row.
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = torch.promote_types(weight.dtype, sum_dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    x2 = _rows(x, n)
    rows = x2.shape[0]
    if rows == 0:
        return out, (x if residual is None else residual_out)
    out2 = out.view(-1, n)
    r2 = _rows(residual, n) if residual is not None else x2
    ro2 = residual_out.view(-1, n) if residual_out is not None else x2
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x2,
        r2,
        weight.contiguous(),
        out2,
        ro2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        ro2.stride(0),
        n,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    if residual is None:
        return out, x
    assert residual_out is not None
    return out, residual_out
