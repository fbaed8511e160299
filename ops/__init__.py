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

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from ops.activation import silu_and_mul_ref
from ops.attention import paged_attention_ref
from ops.norm import rms_norm_ref
from ops.rotary import RopeScaling, rope_cos_sin_cache, rotary_kv_write_ref
from ops.sampling import SamplerOutput, SamplingTensors, sample_ref

BACKENDS = ("auto", "torch", "triton")
_BACKEND = "auto"
P = ParamSpec("P")
R = TypeVar("R")
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


def _op(ref: Callable[P, R], module: str, name: str) -> Callable[P, R]:
    """The op with `ref`'s signature: `module.name` (imported on first use) when the first
    argument's device runs Triton under the current backend, else `ref` itself."""
    kernel: Callable[P, R] | None = None

    @functools.wraps(ref)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        nonlocal kernel
        first = args[0]
        assert isinstance(first, torch.Tensor)
        if not uses_triton(first.device):
            return ref(*args, **kwargs)
        if kernel is None:
            kernel = getattr(importlib.import_module(module), name)
        return kernel(*args, **kwargs)

    op.__name__ = op.__qualname__ = ref.__name__.removesuffix("_ref")
    return op


rms_norm = _op(rms_norm_ref, "ops.norm_triton", "rms_norm_triton")
silu_and_mul = _op(silu_and_mul_ref, "ops.activation_triton", "silu_and_mul_triton")
# The kernel rotates q and k in place (the reference returns new tensors).
rotary_kv_write = _op(rotary_kv_write_ref, "ops.rotary_triton", "rotary_kv_write_triton")
paged_attention = _op(paged_attention_ref, "ops.attention_triton", "paged_attention_triton")
sample = _op(sample_ref, "ops.sampling_triton", "sample_triton")


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
