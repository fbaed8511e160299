"""Whole-block copies in the paged KV cache.

- `copy_blocks_ref`: within one cache tensor (copy-on-write of a shared prefix block),
  one block at a time. Its Triton kernel (one launch per call) is `copy_blocks_triton`
  in ops/block_copy_triton.py; `ops.copy_blocks` picks one by the backend.
- `swap_blocks`: between two cache tensors, usually GPU <-> pinned host memory
  (preemption by swapping); one gather, one transfer and one scatter per call,
  whatever the number of blocks. `swap_blocks_ref` is the per-block loop.

Caches are [num_blocks, block_size, kv_heads, head_dim], one tensor per layer
and per k/v; call once per tensor. Block ids may be given as a sequence of
Python ints (what the block manager holds) or as an int64 tensor on any device;
ids that must move to another device are copied there (a CUDA tensor needed on
the host costs a synchronisation, so prefer ints or CPU tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BlockIds = Sequence[int] | torch.Tensor


def block_index(ids: BlockIds, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64).reshape(-1)
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def _as_list(ids: BlockIds) -> list[int]:
    return [int(i) for i in (ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)]


def check_pairs(src_ids: BlockIds, dst_ids: BlockIds) -> int:
    n, m = len(src_ids), len(dst_ids)
    if n != m:
        raise ValueError(f"{n} source blocks but {m} destination blocks")
    return n


# ----- within one cache -----


def copy_blocks_ref(cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """cache[dst_ids[i]] = cache[src_ids[i]], one block at a time, in order."""
    check_pairs(src_ids, dst_ids)
    for s, d in zip(_as_list(src_ids), _as_list(dst_ids), strict=True):
        cache[d].copy_(cache[s])


# ----- between caches (swap) -----


def swap_blocks_ref(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds
) -> None:
    """dst_cache[dst_ids[i]] = src_cache[src_ids[i]], one blocking copy per block."""
    check_pairs(src_ids, dst_ids)
    for s, d in zip(_as_list(src_ids), _as_list(dst_ids), strict=True):
        dst_cache[d].copy_(src_cache[s])


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds
) -> None:
    """dst_cache[dst_ids[i]] = src_cache[src_ids[i]] for all i, as one batched copy.

    The blocks are gathered on the source device into one contiguous staging
    tensor (index_select), moved in a single transfer, and scattered on the
    destination (index_copy_). Host staging is pinned so the transfer is a real
    DMA. Ordering the caller can rely on, with the current CUDA stream S:

    - GPU -> host (swap out): S is synchronised before the host scatter, so when
      this returns the host cache holds the blocks and the GPU blocks may be
      reused at once. Everything queued on S before the call is waited for.
    - host -> GPU (swap in): the host gather is done when this returns (the host
      blocks may be reused at once); the transfer and the scatter are queued on
      S without blocking the host, so work later queued on S sees the blocks,
      and work on another stream must wait on S first.
    - same device: plain stream-ordered (GPU) or immediate (CPU) copies.

    Destinations must be distinct; src and dst caches must agree in dtype and
    block shape.
    """
    n = check_pairs(src_ids, dst_ids)
    if src_cache.dtype != dst_cache.dtype or src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"cannot swap {src_cache.dtype}{tuple(src_cache.shape)} into "
            f"{dst_cache.dtype}{tuple(dst_cache.shape)}"
        )
    if n == 0:
        return
    if src_cache.dtype == torch.float8_e4m3fn:  # bytes move as bytes (index_copy_ lacks fp8)
        src_cache, dst_cache = src_cache.view(torch.uint8), dst_cache.view(torch.uint8)
    src_dev, dst_dev = src_cache.device, dst_cache.device
    src_idx = block_index(src_ids, src_dev)
    dst_idx = block_index(dst_ids, dst_dev)
    if src_dev == dst_dev:
        dst_cache.index_copy_(0, dst_idx, src_cache.index_select(0, src_idx))
        return
    shape = (n, *src_cache.shape[1:])
    if src_dev.type == "cuda" and dst_dev.type == "cpu":
        staged = src_cache.index_select(0, src_idx)
        host = torch.empty(shape, dtype=src_cache.dtype, pin_memory=True)
        host.copy_(staged, non_blocking=True)
        # The host scatter below runs now, on the CPU: the DMA must have landed.
        torch.cuda.current_stream(src_dev).synchronize()
        dst_cache.index_copy_(0, dst_idx, host)
    elif src_dev.type == "cpu" and dst_dev.type == "cuda":
        host = torch.empty(shape, dtype=src_cache.dtype, pin_memory=True)
        torch.index_select(src_cache, 0, src_idx, out=host)
        # Pinned source: asynchronous for the host, ordered on the stream before
        # the scatter; the caching host allocator keeps `host` alive until done.
        dst_cache.index_copy_(0, dst_idx, host.to(dst_dev, non_blocking=True))
    else:
        dst_cache.index_copy_(0, dst_idx, src_cache.index_select(0, src_idx).to(dst_dev))
