"""Triton kernels: SwiGLU (silu(gate) * up) and GeGLU (gelu_tanh(gate) * up, Gemma) on a merged
gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); tanh(u) = 1 - 2 / (e^2u + 1)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)) * up
    else:  # silu(g) = g * sigmoid(g); for very negative g, exp(-g) is inf and this is -0.
        y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """x: [..., 2 * d] = [gate | up]; return silu(gate) * up, [..., d], in x's dtype.

    Computed in float32 and rounded once. `out` optionally receives the result
    (contiguous, [..., d]). One launch, grid (rows, ceil(d / 1024)). `gelu`: GeGLU instead.
    """
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"last dim {two_d} is not even")
    d = two_d // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0 or d == 0:
        return out
    out2 = out.view(-1, d)
    block = min(_BLOCK, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, GELU=gelu,
                               num_warps=4)
    return out


def gelu_tanh_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU), as silu_and_mul_triton."""
    return silu_and_mul_triton(x, out=out, gelu=True)
