"""SwiGLU and GeGLU activations on a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x is [..., 2 * d] = [gate | up]; return silu(gate) * up, [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): x is [..., 2 * d] = [gate | up]; return gelu_tanh(gate) * up, [..., d],
    GELU's tanh approximation as transformers' gelu_pytorch_tanh."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
