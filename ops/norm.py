"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norm(x + residual) * weight, x + residual).

    With no residual the second value is x itself. The sum is kept in the input
    dtype (as Hugging Face does), the normalisation runs in float32.
    """
    if residual is not None:
        x = x + residual
    residual_out = x
    if x.dtype == weight.dtype == torch.float32:
        # torch's fused kernel: the same formula in one op (bit-identical in float32 on the
        # CPU, where this reference runs for serving).
        return torch.rms_norm(x, x.shape[-1:], weight, eps), residual_out
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    out = xf * torch.rsqrt(variance + eps)
    return weight * out.to(x.dtype), residual_out
