"""Kernels the model is built from. Each op has a torch reference (`*_ref`) and,
later, a Triton kernel with the same signature; the names exported here pick
one by device. `set_backend("torch")` forces the references (tests, CPU)."""

from __future__ import annotations

from ops.activation import silu_and_mul_ref
from ops.attention import paged_attention_ref
from ops.norm import rms_norm_ref
from ops.rotary import RopeScaling, rope_cos_sin_cache, rotary_kv_write_ref

_BACKEND = "auto"


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA, torch elsewhere), 'torch', or 'triton'."""
    global _BACKEND
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"ops backend must be auto, torch or triton, not {name!r}")
    _BACKEND = name


def backend() -> str:
    return _BACKEND


# Until the Triton kernels land, every backend resolves to the references.
rms_norm = rms_norm_ref
silu_and_mul = silu_and_mul_ref
rotary_kv_write = rotary_kv_write_ref
paged_attention = paged_attention_ref

__all__ = [
    "RopeScaling",
    "backend",
    "paged_attention",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_kv_write",
    "set_backend",
    "silu_and_mul",
]
