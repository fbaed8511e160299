"""The CPU model's weights in 2 MB pages (transparent huge pages, where the kernel offers them).

Why: a decode step streams every weight once, ~100 MB for the default model. In 4 KB pages
that is ~25,000 pages a step, more than the TLB holds, so the stream pays a page walk every
4 KB, and in a virtual machine a walk of two page tables. On the 2-core AMD EPYC of this
project (a VM) a plain two-thread read of 100 MB runs 1.2-1.4x faster in 2 MB pages, but the
default model's int24 decode step (then the default), bound by its integer work as much as by
memory, gained nothing (benchmarks/native_ab.py; BENCHMARKS.md): so --cpu-huge-pages is off by default.

How: one anonymous mapping, 2 MB-aligned, `madvise(MADV_HUGEPAGE)` before it is touched
(so the faults take huge pages where the kernel has them: THP "always" or "madvise"), the
model's large storages copied into it, and every tensor on them re-pointed in place
(`Tensor.set_`), so whoever holds a tensor sees the moved one. Where the kernel has no huge
pages the mapping is plain memory: the same bits, the old speed.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20
ALIGN = 64  # every storage starts on a cache line (and on any element size)
MIN_BYTES = 64 << 10  # smaller storages are not worth a copy

# Arenas alive, (start, end) addresses and their mapping (weakly): a storage already inside
# one is not moved again (a model shared by several runners is moved once). An arena whose
# tensors are all gone is unmapped and dropped here: its addresses may be handed out again.
_arenas: list[tuple[int, int, weakref.ref[mmap.mmap]]] = []


def thp_mode() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"), or "" where
    it cannot be read."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "")


def arena(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes`, 2 MB-aligned, advised into huge pages."""
    mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    start = ctypes.addressof(view)
    del view  # releases the buffer export (the mapping stays, owned by the tensor below)
    offset = (-start) % HUGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except (AttributeError, OSError, ValueError):
        pass  # no THP here: plain pages
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    _arenas.append((tensor.data_ptr(), tensor.data_ptr() + nbytes, weakref.ref(mapping)))
    return tensor


def in_arena(ptr: int) -> bool:
    """Whether address `ptr` lies in an arena made here (its storage holds many tensors)."""
    return _arena_of(ptr) is not None


def _arena_of(ptr: int) -> tuple[int, int] | None:
    _arenas[:] = [a for a in _arenas if a[2]() is not None]
    return next(((lo, hi) for lo, hi, _ in _arenas if lo <= ptr < hi), None)


def _tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    """Parameters, buffers and plain tensor attributes (a QuantLinear's `packed`) of every
    submodule."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


@torch.no_grad()
def move_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> tuple[int, int]:
    """Moves the CPU storages of `model` of at least `min_bytes` into one huge-page arena;
    returns (bytes of the arenas that hold them, bytes of those in huge pages). Storages
    already in an arena stay there and are counted: a second runner on the same load (a
    benchmark's engine a batch size) reports the pages its weights are in, not (0, 0). Call
    it before anything keeps raw pointers into the weights (the C decoder does)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    placed: set[tuple[int, int]] = set()  # arenas already holding some of them
    for t in _tensors(model):
        if t.device.type != "cpu" or t.layout != torch.strided:  # oneDNN's packed weights are opaque
            continue
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if s.nbytes() < min_bytes:
            continue
        if (where := _arena_of(ptr)) is not None:
            placed.add(where)
            continue
        if all(t is not u for u in by_storage.get(ptr, ())):
            by_storage.setdefault(ptr, []).append(t)
        storages[ptr] = s
    held = sum(hi - lo for lo, hi in placed)
    huge = sum(max(0, huge_bytes_at(lo)) for lo, _ in placed)
    if not storages:
        return held, huge
    offsets, total = {}, 0
    for ptr, s in storages.items():
        offsets[ptr] = total
        total += -(-s.nbytes() // ALIGN) * ALIGN
    dest = arena(total)
    dest_storage = dest.untyped_storage()
    base = dest.data_ptr() - dest_storage.data_ptr()  # 0: the tensor starts its storage
    # One storage at a time, each old one freed (and its pages given back) once its tensors
    # point into the arena: the move holds the weights once and a storage, not twice.
    for ptr in list(storages):
        s = storages.pop(ptr)
        off, n = base + offsets[ptr], s.nbytes()
        source = torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,), (1,))
        dest[offsets[ptr] : offsets[ptr] + n].copy_(source)
        for t in by_storage.pop(ptr):
            size = t.element_size()
            assert off % size == 0
            t.set_(dest_storage, off // size + t.storage_offset(), t.size(), t.stride())
        del source, s
        if n >= TRIM_BYTES:
            trim_heap()
    trim_heap()
    return held + total, huge + max(0, huge_bytes_at(dest.data_ptr()))


TRIM_BYTES = 1 << 20  # a freed storage of at least this many bytes is given back at once


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim: whole free pages
    anywhere in the heap, not only at its top); nothing elsewhere. Freed weights of the
    sizes the dynamic mmap threshold keeps in the heap otherwise stay resident."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def huge_bytes_at(ptr: int) -> int:
    """Bytes in huge pages of the mapping that holds address `ptr` (its AnonHugePages in
    /proc/self/smaps), or -1 where that cannot be read."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return -1
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= ptr < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return -1
