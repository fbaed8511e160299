"""Paged attention on the CPU with the C kernel for decodes (`cpu_kernels/paged_attention.c`):
the C backend's `paged_attention_c`.

The torch reference copies every decode's keys and values into a padded batch, then runs
SDPA; the kernel reads each cached key and value once, where it lies, for all the query
heads that share it (step times with and without it: `benchmarks.step`, BENCHMARKS.md).
Prefill chunks run the reference's path. float32 only; `available()` is False where the
kernel cannot be built, and `paged_attention_c` then runs the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ops import cpu_kernels
from ops.attention import StepPlan, attend_prefills, paged_attention_ref, plan_for


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("paged_attention")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int
        lib.paged_decode_attention.argtypes = [p, p, p, i32, i32, i32, i32, p, p, i32, p, i32,
                                               ctypes.c_float, p, i32, ctypes.c_int64, ctypes.c_float]
        lib.paged_decode_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and available())


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
           tables: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor,
           window: int | None = None, softcap: float | None = None) -> None:
    """out[rows[i]] = attention of q[rows[i]] over request i's first lens[i] cached tokens
    (with a `window`, the last `window` of them only: the kernel reads no other).
    q, out: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; rows, lens: [n] int64;
    tables: [n, max_blocks] int64. All contiguous but q (a view of the fused qkv output)."""
    lib = _library()
    q = q.contiguous()
    assert lib is not None and usable(q, k_cache) and v_cache.is_contiguous() and out.is_contiguous()
    assert rows.dtype == tables.dtype == lens.dtype == torch.int64
    assert tables.is_contiguous() and rows.is_contiguous() and lens.is_contiguous()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rc = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_size, num_kv_heads, q.shape[1],
        head_dim, rows.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), rows.shape[0],
        scale, out.data_ptr(), torch.get_num_threads(), window or 0, softcap or 0.0)
    if rc:
        raise RuntimeError(f"paged decode attention failed ({rc}): bad shapes or lengths")


def paged_attention_c(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    plan: StepPlan | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s contract: prefill chunks as the reference runs them, every
    decode in one call of the C kernel; the reference itself where the kernel is not
    `usable` (not float32, not built here)."""
    if not usable(q, k_cache):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                   max_query_len, max_seq_len, scale, plan, window,
                                   softcap=softcap)
    p = plan_for(plan, block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    out = torch.empty_like(q)
    attend_prefills(p, q, k_cache, v_cache, scale, out, window, softcap=softcap)
    d = p.decodes
    if d is not None:
        decode(q, k_cache, v_cache, d.rows, d.tables, d.lens, scale, out, window=window, softcap=softcap)
    return out
