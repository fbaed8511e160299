"""Triton kernel: whole-block copies within one paged KV cache (copy-on-write), one launch
per call. Same contract as `copy_blocks_ref` in ops/block_copy.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops.block_copy import BlockIds, block_index, check_pairs

# Same-sized integer views: a block copy is bit-exact whatever the cache dtype
# (fp8 included), and the interpreter need not know the float type.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BLOCK = 2048


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, src_ptr, dst_ptr, block_stride, block_numel, BLOCK: tl.constexpr
):
    pair = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    # int64: num_blocks * block_stride can pass 2**31 elements in a large cache.
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    vals = tl.load(cache_ptr + src * block_stride + offs, mask=mask)
    tl.store(cache_ptr + dst * block_stride + offs, vals, mask=mask)


def copy_blocks_triton(cache: torch.Tensor, src_ids: BlockIds, dst_ids: BlockIds) -> None:
    """cache[dst_ids[i]] = cache[src_ids[i]] for all i, in one launch.

    Pairs run in parallel, so no destination may also be a source in the same
    call, nor appear twice (copy-on-write always copies into fresh blocks). Each
    block (dims 1..3) must be contiguous. Grid (pairs, ceil(block_numel / 2048)).
    """
    n = check_pairs(src_ids, dst_ids)
    if n == 0:
        return
    inner = cache[0]
    if not inner.is_contiguous():
        raise ValueError("copy_blocks needs each cache block to be contiguous")
    flat = cache.view(_INT_OF_SIZE[cache.element_size()])
    src = block_index(src_ids, cache.device)
    dst = block_index(dst_ids, cache.device)
    numel = inner.numel()
    block = min(_BLOCK, triton.next_power_of_2(numel))
    grid = (n, triton.cdiv(numel, block))
    _copy_blocks_kernel[grid](flat, src, dst, cache.stride(0), numel, BLOCK=block, num_warps=4)
