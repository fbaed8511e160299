"""A GGUF file's metadata and tensors, read in one pass over one memory map.

gguf.GGUFReader builds numpy views for every part of every metadata value: the default
model's 98,000 vocabulary and merge strings cost it several seconds of each worker's start.
Here the header is read with struct from the map (a tenth of a second), and each tensor's
data is a numpy view of the same map, shaped as GGUFReader shapes it (a block-quantized
matrix as [rows, bytes per row]). The gguf package still supplies the type tables and the
dequantizers.

The layout (little-endian, version 2 or 3):

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv x      key: string | u32 value type | value
    n_tensors x name: string | u32 n_dims | u64 dims[n_dims] (fastest first) | u32 type | u64 offset
    padding to general.alignment (32) | tensor data (each offset is from here)

A string is a u64 length and that many UTF-8 bytes; an array is a u32 item type, a u64
count and the items. Every length and offset is checked against the file's size first, so a
damaged or hostile file gets a ValueError naming what was wrong, not a huge allocation: a
metadata string longer than MAX_STRING_BYTES, tensor data that is not aligned, runs past the
end or overlaps another tensor's, are refused.

The map's pages a tensor was read through count in the process's resident memory while it
stays mapped: `release` gives them back (the loader calls it once a tensor is repacked).
"""

from __future__ import annotations

import itertools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DEPTH = 4  # arrays of arrays
_STRING, _ARRAY = 8, 9
# Longest metadata string read (a chat template is a few KB, the longest known ~100 KB; a
# token a few bytes): a string of megabytes is a damaged or hostile file.
MAX_STRING_BYTES = 1 << 20
# value type -> struct format (8: string and 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
# tensor types held as elements, not blocks (as GGUFReader holds them)
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    n_bytes: int
    offset: int  # of its data, from the file's start
    data: np.ndarray  # read-only view of the file: elements, or [rows, bytes per row] blocks


class GGUFFile:
    """`fields`: metadata key -> Python value (str, int, float, bool, or a list of them; an
    array of arrays stays nested, where gguf's ReaderField.contents() flattens it);
    `tensors`: in the file's order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"cannot map the file: {e}") from e
        self._pos = 0
        if self._take(4) != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = self._scalar("<I")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file; only little-endian ones are read")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(self._count(n_kv, 13, "metadata entries")):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key[:100]!r} appears twice")
            self.fields[key] = self._value(self._scalar("<I"), 0)
        infos = [self._tensor_info() for _ in range(self._count(n_tensors, 24, "tensors"))]
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, alignment, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")
        _check_disjoint(self.tensors)
        self.data_start = start
        self.release(0, start)  # the header's pages: its values are Python objects now

    # ----- reading -----

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise ValueError(f"truncated: {n} bytes wanted at offset {self._pos}, "
                             f"the file has {len(self._map)}")
        out = self._map[self._pos : end]
        self._pos = end
        return out

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _count(self, n: int, min_item_bytes: int, what: str) -> int:
        if n * min_item_bytes > len(self._map) - self._pos:
            raise ValueError(f"{n} {what} cannot fit in the {len(self._map) - self._pos} bytes left")
        return n

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the process's pages of the file's bytes [offset, offset + nbytes) (whole pages
        within them and the pages they start and end in: a neighbour read through those faults
        them back in from the page cache). The map stays valid; a later read re-reads."""
        page = mmap.PAGESIZE
        lo = offset // page * page
        hi = min(-(-(offset + nbytes) // page) * page, len(self._map))
        if hi > lo:
            try:
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (AttributeError, OSError, ValueError):  # no madvise here: the pages stay
                pass

    def _string(self) -> str:
        n = self._count(self._scalar("<Q"), 1, "string bytes")
        if n > MAX_STRING_BYTES:
            raise ValueError(f"a metadata string of {n} bytes at offset {self._pos - 8} (at most "
                             f"{MAX_STRING_BYTES} are read)")
        try:
            return self._take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"a string at offset {self._pos - n} is not UTF-8: {e}") from e

    def _value(self, vtype: int, depth: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self._pos - 4}")
        if depth >= _MAX_DEPTH:
            raise ValueError(f"arrays nested deeper than {_MAX_DEPTH}")
        itype, n = self._scalar("<I"), self._scalar("<Q")
        if itype in _SCALARS:  # one numpy read, not n struct calls (token types: 49,152)
            dtype = np.dtype(_SCALARS[itype])
            self._count(n, dtype.itemsize, "array items")
            items = np.frombuffer(self._map, dtype, n, self._pos).tolist()
            self._pos += n * dtype.itemsize
            return items
        self._count(n, 8 if itype == _STRING else 12, "array items")
        if itype == _STRING:
            return [self._string() for _ in range(n)]
        return [self._value(itype, depth + 1) for _ in range(n)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name[:100]!r} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = struct.unpack(f"<{n_dims}Q", self._take(8 * n_dims))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, start: int, alignment: int, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name[:100]!r} has unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims, dtype=object))
        if dims[0] % block:
            raise ValueError(f"tensor {name[:100]!r}: {dims[0]} columns are not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        if offset % alignment:
            raise ValueError(f"tensor {name[:100]!r}: its data offset {offset} is not a multiple of "
                             f"the alignment {alignment}")
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"tensor {name[:100]!r}: {n_bytes} bytes at {begin} run past the "
                             f"file's {len(self._map)}")
        np_dims = tuple(reversed(dims))
        if qtype in _ELEMENT_DTYPES:
            data = np.frombuffer(self._map, _ELEMENT_DTYPES[qtype], n_elems, begin).reshape(np_dims)
        else:
            data = np.frombuffer(self._map, np.uint8, n_bytes, begin).reshape(
                quant_shape_to_byte_shape(np_dims, qtype))
        return GGUFTensor(name, qtype, dims, n_bytes, begin, data)


def _check_disjoint(tensors: list[GGUFTensor]) -> None:
    """Each tensor's bytes (its size as its type and shape give it) end before the next one's
    data begins: a size the file's layout disagrees with would read another tensor's bytes."""
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.n_bytes > b.offset:
            raise ValueError(f"tensor {a.name[:100]!r}: {a.n_bytes} bytes ({a.tensor_type.name}, shape "
                             f"{list(a.shape)}) at {a.offset} overlap tensor {b.name[:100]!r} at {b.offset}")
