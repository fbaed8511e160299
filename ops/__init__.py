"""Kernels the model is built from. Each op has a torch reference (`*_ref`) and a Triton
kernel (`*_triton`, in `ops/*_triton.py`) with the same signature; the names exported
here pick one per call by the backend and the input's device:

    backend   CUDA tensor    CPU tensor
    auto      Triton         torch reference
    torch     reference      reference
    triton    Triton         Triton (needs TRITON_INTERPRET=1, tests only)

Triton modules are imported on first use, so a CPU-only install never imports triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from ops.activation import silu_and_mul_ref
from ops.attention import paged_attention_ref
from ops.norm import rms_norm_ref
from ops.rotary import RopeScaling, rope_cos_sin_cache, rotary_kv_write_ref
from ops.sampling import SamplerOutput, SamplingTensors, sample_ref

BACKENDS = ("auto", "torch", "triton")
_BACKEND = "auto"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA, torch elsewhere), 'torch', or 'triton'."""
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"ops backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "triton" and not _HAS_TRITON:
        raise ValueError("ops backend 'triton' needs the triton package, which is not installed")
    _BACKEND = name


def backend() -> str:
    return _BACKEND


def uses_triton(device: torch.device) -> bool:
    """Whether ops on `device` run the Triton kernels under the current backend."""
    if _BACKEND == "torch":
        return False
    if _BACKEND == "triton":
        return True
    return device.type == "cuda" and _HAS_TRITON


_kernels: dict[str, Callable[..., Any]] = {}


def _kernel(module: str, name: str) -> Callable[..., Any]:
    fn = _kernels.get(name)
    if fn is None:
        fn = _kernels[name] = getattr(importlib.import_module(module), name)
    return fn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_triton(x.device):
        return _kernel("ops.norm_triton", "rms_norm_triton")(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if uses_triton(x.device):
        return _kernel("ops.activation_triton", "silu_and_mul_triton")(x)
    return silu_and_mul_ref(x)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ops.rotary.rotary_kv_write_ref. The kernel rotates q and k in place."""
    fn = (
        _kernel("ops.rotary_triton", "rotary_kv_write_triton")
        if uses_triton(q.device)
        else rotary_kv_write_ref
    )
    return fn(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def paged_attention(
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
    fn = (
        _kernel("ops.attention_triton", "paged_attention_triton")
        if uses_triton(q.device)
        else paged_attention_ref
    )
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
              max_seq_len, scale)


def sample(logits: torch.Tensor, st: SamplingTensors) -> SamplerOutput:
    if uses_triton(logits.device):
        return _kernel("ops.sampling_triton", "sample_triton")(logits, st)
    return sample_ref(logits, st)


__all__ = [
    "BACKENDS",
    "RopeScaling",
    "SamplerOutput",
    "SamplingTensors",
    "backend",
    "paged_attention",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_kv_write",
    "sample",
    "set_backend",
    "silu_and_mul",
    "uses_triton",
]
