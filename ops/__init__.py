"""Kernels the model is built from, and the one place that picks their implementation.

Each op has up to three implementations with one signature:

- the torch reference, `*_ref` (ops/<op>.py): pure torch, no C kernel, no state kept
  between calls; what every kernel is tested against;
- a C kernel for the CPU, `*_c` (ops/cpu_*.py over ops/cpu_kernels/*.c, built with gcc on
  first use): today decode attention (`paged_attention_c`; its prefill chunks run the
  reference), sampling (`sample_c`, ops/cpu_sampling.py) and logprobs (`token_logprobs_c`,
  ops/cpu_logprobs.py); ops without one run their
  reference under this backend;
- a Triton kernel, `*_triton` (ops/<op>_triton.py).

The names exported here pick one per call by the backend (`set_backend`, the `--kernels`
flag) and the device of the first argument:

    backend   CUDA tensor    CPU tensor
    auto      Triton         C kernels (reference where they cannot build or run: no gcc,
                             no AVX2/FMA/F16C, not float32)
    torch     reference      reference
    c         reference      C kernels (set_backend refuses where they cannot build)
    triton    Triton         Triton (needs TRITON_INTERPRET=1: tests only)

Linear layers are not chosen here: the runner picks them at load (`--cpu-quantized-linear`:
the C kernel on GGUF blocks, ops/quantized_linear.py; `--cpu-packed-linear`: oneDNN
through torch, ops/linear.py; else torch's F.linear). So `--kernels torch` gives the pure
reference for attention, norm, rotary, activation, sampling and block copies; add
`--no-cpu-quantized-linear --no-cpu-packed-linear` for an all-torch model. A pre-quantized
checkpoint's linears (FP8, INT8, INT4: ops/scaled_linear.py) are the one exception, since
their weights exist only quantized: `scaled_linear` dispatches like the ops above (Triton
on CUDA, the reference elsewhere; the CPU dequantizes such weights at load instead).

Kernel modules are imported on first use: a CPU install without triton never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, Literal, ParamSpec, TypeVar

import torch

from ops.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from ops.attention import StepPlan, paged_attention_ref
from ops.block_copy import copy_blocks_ref, swap_blocks
from ops.lora import LoraRows, LoraStack, lora_add_ref
from ops.norm import rms_norm_ref
from ops.rotary import RopeScaling, rope_cos_sin_cache, rotary_kv_write_ref
from ops.sampling import (
    SAMPLING_EPS,
    SamplerOutput,
    SamplingTensors,
    sample_ref,
    token_logprobs_ref,
)
from ops.scaled_linear import scaled_linear_ref

BACKENDS = ("auto", "torch", "c", "triton")
KernelPath = Literal["torch", "c", "triton"]
_BACKEND = "auto"
P = ParamSpec("P")
R = TypeVar("R")


def _installed(name: str) -> bool:
    """Whether `name` can be found, without importing it (triton takes seconds to import)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it: as good as not installed
        return False


_HAS_TRITON = _installed("triton")


def set_backend(name: str) -> None:
    """One of BACKENDS (see the table above); checked here, at start-up, not per call."""
    global _BACKEND
    if name not in BACKENDS:
        raise ValueError(f"ops backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "triton" and not _HAS_TRITON:
        raise ValueError("ops backend 'triton' needs the triton package, which is not installed")
    if name == "c" and not c_kernels_available():
        raise ValueError("ops backend 'c' needs the CPU C kernels, which cannot be built here "
                         "(they need gcc and a CPU with AVX2, FMA and F16C)")
    _BACKEND = name


def backend() -> str:
    return _BACKEND


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the duration of a block (tests and benchmarks)."""
    before = _BACKEND
    set_backend(name)
    try:
        yield
    finally:
        set_backend(before)


def c_kernels_available() -> bool:
    """Whether the C kernels build and run on this machine (builds them on first call)."""
    from ops import cpu_attention

    return cpu_attention.available()


def kernel_path(device: torch.device) -> KernelPath:
    """Which implementations ops on `device` run under the current backend."""
    if _BACKEND in ("torch", "triton"):
        return _BACKEND  # type: ignore[return-value]
    if device.type == "cuda":
        return "triton" if _BACKEND == "auto" and _HAS_TRITON else "torch"
    return "c" if device.type == "cpu" else "torch"


def uses_triton(device: torch.device) -> bool:
    """Whether ops on `device` run the Triton kernels under the current backend."""
    return kernel_path(device) == "triton"


@functools.cache
def _load(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), name)


def _op(ref: Callable[P, R], triton: tuple[str, str], c: tuple[str, str] | None = None) -> Callable[P, R]:
    """The op with `ref`'s signature: by `kernel_path` of the first argument's device, the
    Triton kernel `triton` or the C kernel `c` (module, name; imported on first use), else
    `ref` itself."""

    @functools.wraps(ref)
    def op(*args: P.args, **kwargs: P.kwargs) -> R:
        first = args[0]
        assert isinstance(first, torch.Tensor)
        path = kernel_path(first.device)
        if path == "triton":
            return _load(*triton)(*args, **kwargs)
        if path == "c" and c is not None:
            return _load(*c)(*args, **kwargs)
        return ref(*args, **kwargs)

    op.__name__ = op.__qualname__ = ref.__name__.removesuffix("_ref")
    return op


rms_norm = _op(rms_norm_ref, ("ops.norm_triton", "rms_norm_triton"))
silu_and_mul = _op(silu_and_mul_ref, ("ops.activation_triton", "silu_and_mul_triton"))
gelu_tanh_and_mul = _op(gelu_tanh_and_mul_ref, ("ops.activation_triton", "gelu_tanh_and_mul_triton"))
# The kernel rotates q and k in place (the reference returns new tensors).
rotary_kv_write = _op(rotary_kv_write_ref, ("ops.rotary_triton", "rotary_kv_write_triton"))
paged_attention = _op(paged_attention_ref, ("ops.attention_triton", "paged_attention_triton"),
                      c=("ops.cpu_attention", "paged_attention_c"))
sample = _op(sample_ref, ("ops.sampling_triton", "sample_triton"), c=("ops.cpu_sampling", "sample_c"))
# Prompt logprobs (worker/prompt_logprobs.py); the sampler's own take the same kernel. On
# CUDA the reference (its log_softmax and topk are the GPU's own kernels).
token_logprobs = _op(token_logprobs_ref, ("ops.sampling", "token_logprobs_ref"),
                     c=("ops.cpu_logprobs", "token_logprobs_c"))
copy_blocks = _op(copy_blocks_ref, ("ops.block_copy_triton", "copy_blocks_triton"))
# A linear over a pre-quantized checkpoint's weight (FP8, INT8, INT4; ops/scaled_linear.py):
# Triton on CUDA; the CPU dequantizes such weights at load, so only tests call the reference.
scaled_linear = _op(scaled_linear_ref, ("ops.scaled_linear_triton", "scaled_linear_triton"))
# Each LoRA row's adapter delta added to a linear's output (ops/lora.py): one gathered bmm
# per layer in torch on the CPU (the C path has no kernel of its own: the linears are the
# cost there, not this), segmented Triton kernels on CUDA.
lora_add = _op(lora_add_ref, ("ops.lora_triton", "lora_add_triton"))


__all__ = [
    "BACKENDS",
    "SAMPLING_EPS",
    "LoraRows",
    "LoraStack",
    "RopeScaling",
    "SamplerOutput",
    "SamplingTensors",
    "StepPlan",
    "backend",
    "c_kernels_available",
    "copy_blocks",
    "gelu_tanh_and_mul",
    "kernel_path",
    "lora_add",
    "paged_attention",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_kv_write",
    "sample",
    "scaled_linear",
    "set_backend",
    "silu_and_mul",
    "swap_blocks",
    "token_logprobs",
    "use_backend",
    "uses_triton",
]
