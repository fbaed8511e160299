"""How many bytes the KV cache gets: the memory flags' arithmetic, kept apart from the device
so that tests can hand it any device memory.

First rule that applies:

1. ``--kv-cache-memory-bytes`` / ``--kv-cache-memory``: that size (on CUDA it must fit in
   the memory free now).
2. CPU: 1 GiB (``--gpu-memory-utilization`` does not apply there; a log line says so).
3. ``--kv-cache-free-memory-fraction F``: F of the device memory free once the weights are
   loaded (the worker's rule before ``--gpu-memory-utilization`` took vLLM's meaning).
4. ``--gpu-memory-utilization U`` (vLLM's meaning): this worker may use U of the device's
   TOTAL memory, weights, activations and KV cache together:

       kv = U * total - weights - activation reserve

   Like vLLM, it refuses to start when U * total is more than was free when it started
   (other processes hold the rest), or when weights and activations leave nothing. vLLM
   measures activations with a profile run; here they are estimated from the step's shape
   (`activation_reserve`, a generous figure: doubled), and the CUDA context counts as
   memory held by others, as in vLLM (its snapshot is taken after the context exists).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.config import CacheConfig, SchedulerConfig

log = logging.getLogger(__name__)

GiB = 1 << 30
CPU_DEFAULT_BYTES = GiB


@dataclass(frozen=True)
class DeviceMemory:
    """One CUDA device's memory as the worker sees it once its weights are loaded."""

    total: int  # the device's memory
    free: int  # free now (cudaMemGetInfo)
    held: int  # held by this process's allocator now: the weights (torch.cuda.memory_reserved)

    @property
    def free_at_start(self) -> int:
        """What was free before this process allocated: what it holds was free then."""
        return self.free + self.held


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The CUDA device's memory; None for the CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, held=torch.cuda.memory_reserved(device))


class ModelShape(Protocol):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def activation_reserve(m: ModelShape, sc: SchedulerConfig, max_model_len: int,
                       itemsize: int) -> int:
    """Bytes one step's activations may take at their peak, estimated: a step of the token
    budget's tokens holds, inside one layer, the residual stream and its normed copy,
    q/k/v, the attention output, the MLP's gate, up and activated rows and its output;
    logits are computed for the sampled rows only (`max_num_seqs` of them, float32, with
    room for the sampler's probabilities and sorted copies). Doubled for the allocator's
    fragmentation and the kernels' temporaries."""
    tokens = sc.max_num_batched_tokens
    if not sc.enable_chunked_prefill:  # the scheduler raises the budget to fit any prompt
        tokens = max(tokens, max_model_len)
    per_token = (4 * m.hidden_size + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                 + 3 * m.intermediate_size) * itemsize
    logits = sc.max_num_seqs * m.vocab_size * 4 * 3
    return 2 * (tokens * per_token + logits)


def kv_cache_bytes(cache: CacheConfig, mem: DeviceMemory | None, activations: int) -> int:
    """The KV cache's size in bytes by the rules in the module docstring; raises ValueError
    naming the flag when they cannot be met."""
    fixed = cache.kv_cache_bytes
    if fixed:
        if mem is not None and fixed > mem.free:
            raise ValueError(f"the KV cache size asked for ({_gib(fixed)}) is more than the "
                             f"device has free ({_gib(mem.free)} of {_gib(mem.total)}); lower "
                             "--kv-cache-memory-bytes / --kv-cache-memory")
        log.info("KV cache: %s, as --kv-cache-memory-bytes / --kv-cache-memory give", _gib(fixed))
        return fixed
    if mem is None:
        log.info("KV cache: %s (the CPU default; --kv-cache-memory-bytes sets it). "
                 "--gpu-memory-utilization %g is ignored on the CPU",
                 _gib(CPU_DEFAULT_BYTES), cache.gpu_memory_utilization)
        return CPU_DEFAULT_BYTES
    if cache.kv_cache_free_memory_fraction:
        kv = int(mem.free * cache.kv_cache_free_memory_fraction)
        log.info("KV cache: %s = --kv-cache-free-memory-fraction %g of the %s free after the "
                 "weights", _gib(kv), cache.kv_cache_free_memory_fraction, _gib(mem.free))
        return kv
    util = cache.gpu_memory_utilization
    requested = int(mem.total * util)
    if requested > mem.free_at_start:
        raise ValueError(
            f"free memory on the device at start ({_gib(mem.free_at_start)} of "
            f"{_gib(mem.total)}) is less than --gpu-memory-utilization {util:g} asks for "
            f"({_gib(requested)}); other processes hold "
            f"{_gib(mem.total - mem.free_at_start)}. Lower --gpu-memory-utilization, free "
            "the device, or give the KV cache a size (--kv-cache-memory-bytes)")
    kv = requested - mem.held - activations
    if kv <= 0:
        raise ValueError(
            f"no memory is left for the KV cache: weights ({_gib(mem.held)}) and the "
            f"activation reserve ({_gib(activations)}) take all that --gpu-memory-utilization "
            f"{util:g} allows ({_gib(requested)} of {_gib(mem.total)}); raise it, or lower "
            "--max-num-batched-tokens")
    log.info("KV cache: %s = --gpu-memory-utilization %g of %s (%s) - weights %s - "
             "activation reserve %s", _gib(kv), util, _gib(mem.total), _gib(requested),
             _gib(mem.held), _gib(activations))
    return kv


def host_available_bytes() -> int | None:
    """The host's MemAvailable (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_room(kv_bytes: int) -> None:
    """A CPU KV cache larger than the host's available memory: a clear error before it is
    allocated (40 GB on a 23 GiB host was killed by the OOM killer, without a word; 100 TB
    ended in the allocator's traceback)."""
    available = host_available_bytes()
    if available is not None and kv_bytes > available:
        raise ValueError(f"the KV cache size asked for ({_gib(kv_bytes)}) is more than this "
                         f"host has available ({_gib(available)}); lower "
                         "--kv-cache-memory-bytes / --kv-cache-memory")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_cache_dtype(name: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype as a dtype. float16 is read and written by the CPU's C kernels (the
    fused decoder converts as it writes, and its attention as it loads) and by the torch
    references; fp8 (fp8_e4m3) by the GPU's Triton kernels (and the torch references), over
    per-tensor scales (the model's Attention.k_scale / v_scale)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        if device.type != "cuda":
            raise ValueError(f"--kv-cache-dtype {name} is for CUDA (the Triton kernels read and write "
                             f"float8_e4m3fn); the CPU's kernels have no fp8: use --kv-cache-dtype "
                             "float16 there (half of float32's bytes)")
        return torch.float8_e4m3fn
    assert name == "float16", name
    if device.type != "cpu" or model_dtype != torch.float32:
        raise ValueError(f"--kv-cache-dtype float16 is for a float32 model on the CPU (its C kernels); "
                         f"here the model is {str(model_dtype).removeprefix('torch.')} on {device.type}: "
                         "use --kv-cache-dtype auto")
    return torch.float16
