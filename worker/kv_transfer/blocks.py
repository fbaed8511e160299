"""A cache's blocks as bytes and back, in its own dtype and layout: per layer, keys then
values, each ``[blocks, block_size, num_kv_heads, head_dim]`` in C order (the runner's
tensors, `worker.model_runner`). Reading needs the blocks pinned (nobody writes them);
writing needs them owned by one request not in any step (WAITING_FOR_REMOTE_KV), so either
runs off the engine thread."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


def block_nbytes(caches: Sequence[KVCache]) -> int:
    """Bytes of one block of one layer's keys (its values: as many)."""
    k = caches[0][0]
    return k[0].numel() * k.element_size()


def runs(num_blocks: int, per_chunk: int) -> Iterator[tuple[int, int]]:
    """(first, count) of consecutive runs of at most `per_chunk` blocks."""
    for first in range(0, num_blocks, per_chunk):
        yield first, min(per_chunk, num_blocks - first)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def read(caches: Sequence[KVCache], layer: int, blocks: Sequence[int]) -> tuple[bytes, bytes]:
    k, v = caches[layer]
    idx = torch.tensor(list(blocks), dtype=torch.long, device=k.device)
    return _bytes(k.index_select(0, idx)), _bytes(v.index_select(0, idx))


def write(caches: Sequence[KVCache], layer: int, blocks: Sequence[int], keys: bytes,
          values: bytes) -> None:
    """Copy `keys` and `values` (as `read` gives them) into `blocks` of `layer`; raises
    ValueError when their sizes are not those blocks'."""
    k, v = caches[layer]
    want = len(blocks) * k[0].numel() * k.element_size()
    if len(keys) != want or len(values) != want:
        raise ValueError(f"layer {layer}: {len(keys)} + {len(values)} bytes for {len(blocks)} "
                         f"blocks of {want // max(1, len(blocks))}")
    idx = torch.tensor(list(blocks), dtype=torch.long, device=k.device)
    shape = (len(blocks), *k.shape[1:])
    with warnings.catch_warnings():  # read-only buffers: only copied from
        warnings.simplefilter("ignore", UserWarning)
        src_k = torch.frombuffer(keys, dtype=torch.uint8).view(k.dtype).view(shape)
        src_v = torch.frombuffer(values, dtype=torch.uint8).view(v.dtype).view(shape)
    with torch.inference_mode():
        k.index_copy_(0, idx, src_k.to(k.device))
        v.index_copy_(0, idx, src_v.to(v.device))
