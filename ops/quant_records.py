"""GGUF blocks -> the CPU kernels' tile records (the layouts: `cpu_kernels/quant_matmul.c` for
Q4_1/Q8_0 in float32, `quant_matmul_int8.c` for their integer layout, `quant_types.h` for
every other type, one layout for both arithmetics).

Records are written a few hundred rows at a time into the one tensor that holds them, so a
weight of any size is repacked with temporaries of a few MB (a 128256 x 2048 LM head
included), and nothing of the file's blocks is kept.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

TILE = 32  # output rows per tile
QBLOCK = 32  # weights per sub-block (every type)


@dataclass(frozen=True)
class RecordType:
    """One GGUF type as the kernels hold it."""

    code: int  # the float kernels' qtype (cpu_kernels/quant_types.h)
    int_code: int  # the integer kernels' (-1: float32 activations only)
    block: int  # weights per GGUF block
    block_bytes: int  # bytes per GGUF block
    group: int  # sub-blocks of 32 per record
    record: int  # bytes per (tile, record)

    @property
    def file_record(self) -> int:
        """The file's bytes for the weights of one record."""
        return TILE * self.block_bytes * self.group * QBLOCK // self.block

    @property
    def k_multiple(self) -> int:
        return self.group * QBLOCK


TYPES: dict[str, RecordType] = {
    "Q4_1": RecordType(0, 2, 32, 20, 1, 640),
    "Q8_0": RecordType(1, 3, 32, 34, 1, 1088),
    "Q4_0": RecordType(4, 4, 32, 18, 1, 576),
    "Q5_0": RecordType(5, 5, 32, 22, 1, 704),
    "Q5_1": RecordType(6, 6, 32, 24, 1, 768),
    "IQ4_NL": RecordType(7, 7, 32, 18, 1, 576),
    "Q4_K": RecordType(8, 8, 256, 144, 8, 4736),
    "Q5_K": RecordType(9, 9, 256, 176, 8, 5760),
    "Q6_K": RecordType(10, 10, 256, 210, 8, 6720),
    "IQ4_XS": RecordType(11, 11, 256, 136, 8, 4416),
    "F16": RecordType(12, -1, 1, 2, 1, 2048),
    "BF16": RecordType(13, -1, 1, 2, 1, 2048),
    # Pre-quantized checkpoints' (quant_types.h; `checkpoint_blocks` writes their blocks):
    "Q4_G128": RecordType(14, 14, 128, 72, 4, 2304),  # f32 d, f32 m, 64 bytes of nibbles
    "Q4_G32": RecordType(15, 15, 32, 24, 1, 768),  # f32 d, f32 m, 16 bytes of nibbles
    "Q8_CH": RecordType(16, 16, 128, 132, 4, 4224),  # f32 d (the channel's), 128 int8
    "Q3_K": RecordType(17, 17, 256, 110, 8, 3648),
    "Q2_K": RecordType(18, 18, 256, 84, 8, 2688),
    # The grid types (quant_types.h): each weight's grid value and sign decoded at load into an
    # index of a table of the type's signed values, 3 bits (IQ2, IQ1: 6 values) or 4 (IQ3).
    "IQ2_XXS": RecordType(19, 19, 256, 66, 8, 3392),
    "IQ2_XS": RecordType(20, 20, 256, 74, 8, 3648),
    "IQ2_S": RecordType(21, 21, 256, 82, 8, 3648),
    "IQ3_XXS": RecordType(22, 22, 256, 98, 8, 4416),
    "IQ3_S": RecordType(23, 23, 256, 110, 8, 4416),
    "IQ1_S": RecordType(24, 24, 256, 50, 8, 3392),
    "IQ1_M": RecordType(25, 25, 256, 56, 8, 3648),
}
GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")

# Rows of the file repacked at once: about this many weights.
_CHUNK_WEIGHTS = 1 << 20


def blocks_of(w) -> np.ndarray:
    """A QuantizedWeight's blocks as [out_features, bytes per row] uint8 (F16 may come as
    float16 elements, as the GGUF reader gives them), checked against its type and shape."""
    t = TYPES[w.qtype]
    n, k = w.shape
    blocks = np.asarray(w.blocks)
    if blocks.dtype != np.uint8:
        blocks = np.ascontiguousarray(blocks).view(np.uint8)
    row = k // t.block * t.block_bytes
    if k % t.block or blocks.size != n * row:
        raise ValueError(f"a {w.qtype} weight of shape {w.shape} needs {n} x {row} bytes, not {blocks.shape}")
    return blocks.reshape(n, row)


def repacked(w, integer: bool) -> torch.Tensor:
    """`w`'s tile records for the float32 kernels or (`integer`) the integer ones, as uint8."""
    t = TYPES[w.qtype]
    n, k = w.shape
    blocks = blocks_of(w)
    pack = _PACKERS[w.qtype, integer and w.qtype in ("Q4_1", "Q8_0")]
    tile = k // t.k_multiple * t.record
    out = torch.empty(n // TILE * tile, dtype=torch.uint8)
    dst = out.numpy().reshape(n // TILE, tile)
    # numpy and the C body release the GIL: chunks (disjoint rows of `out`) on every core,
    # the chunk smaller by as much, so the temporaries in all are what one thread's were.
    threads = max(1, torch.get_num_threads())
    step = max(TILE, _CHUNK_WEIGHTS // threads // k // TILE * TILE)

    def chunk(r0: int) -> None:
        part = pack(blocks[r0 : r0 + step], k)
        dst[r0 // TILE : r0 // TILE + part.shape[0]] = part.reshape(part.shape[0], tile)

    with ThreadPoolExecutor(min(threads, -(-n // step))) as pool:
        list(pool.map(chunk, range(0, n, step)))  # list(): a chunk's error raised here
    return out


def _u16(b: np.ndarray, lo: int) -> np.ndarray:
    """The 2-byte field at bytes lo:lo+2 of each block: [..., 1] uint16."""
    return np.ascontiguousarray(b[..., lo : lo + 2]).view(np.uint16)


def _u32(b: np.ndarray, lo: int) -> np.ndarray:
    """The 4-byte field at bytes lo:lo+4 of each block: [..., 1] uint32 (a float32's bits)."""
    return np.ascontiguousarray(b[..., lo : lo + 4]).view(np.uint32)


def _lanes(a: np.ndarray) -> np.ndarray:
    """A per-row field [n, R, F] as the records' [T, R, F * 32 lanes] bytes (outputs last)."""
    n, r, f = a.shape
    lanes = np.ascontiguousarray(a.reshape(n // TILE, TILE, r, f).transpose(0, 2, 3, 1))
    return lanes.view(np.uint8).reshape(n // TILE, r, -1)


# ---- Q4_1 and Q8_0 (their own layouts) ----

def q_fields(blocks: np.ndarray, qtype: str, k: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Q4_1/Q8_0 blocks -> scales d [T, nb, 32 n] fp16, offsets m (Q4_1) and quants
    [T, nb, 32 n, 32 k] (uint8 for Q4_1, int8 for Q8_0)."""
    n = blocks.shape[0]
    nb = k // QBLOCK
    b = blocks.reshape(n // TILE, TILE, nb, TYPES[qtype].block_bytes).transpose(0, 2, 1, 3)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q4_1":
        qs = b[..., 4:20]  # byte j holds k = j (low nibble) and k = j + 16 (high)
        return d, b[..., 2:4].copy().view(np.float16)[..., 0], np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return d, None, b[..., 2:34].view(np.int8)


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of `a` in its index order: [..., last] -> [..., last * itemsize] uint8."""
    return np.ascontiguousarray(a).view(np.uint8)


def _pack_float(qtype: str):
    def pack(blocks: np.ndarray, k: int) -> np.ndarray:
        d, m, q = q_fields(blocks, qtype, k)
        t, nb = d.shape[:2]
        if qtype == "Q4_1":
            q = q.transpose(0, 1, 3, 2)  # [T, nb, k, n]
            parts = [_bytes(d), _bytes(m), q[..., :16] | (q[..., 16:] << 4)]  # byte j: n = j, j + 16
        else:
            parts = [_bytes(d), q.transpose(0, 1, 3, 2).view(np.uint8)]  # [T, nb, k, n]
        return np.concatenate([np.ascontiguousarray(p).reshape(t, nb, -1) for p in parts], axis=-1)

    return pack


def _pack_int(qtype: str):
    """Chunks of 16 outputs x 4 consecutive k, one output's 4 quants to a 32-bit lane."""
    def pack(blocks: np.ndarray, k: int) -> np.ndarray:
        d, m, q = q_fields(blocks, qtype, k)
        t, nb = d.shape[:2]
        if qtype == "Q4_1":
            # k = 8p + 4s + j: s = 0 goes to the low nibble, s = 1 to the high one.
            q = q.reshape(t, nb, 2, 16, 4, 2, 4).transpose(0, 1, 2, 4, 3, 6, 5)  # [t, nb, h, p, n, j, s]
            parts = [_bytes(d), _bytes(m), (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)]
        else:
            # q + 128: the unsigned side of vpdpbusd (quant_matmul_int8.c's top)
            q = (q.astype(np.int16) + 128).astype(np.uint8)
            parts = [_bytes(d), q.reshape(t, nb, 2, 16, 8, 4).transpose(0, 1, 2, 4, 3, 5)]  # k = 4p + j
        return np.concatenate([np.ascontiguousarray(p).reshape(t, nb, -1) for p in parts], axis=-1)

    return pack


# ---- the qn types (quant_types.h) ----

def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-block's 16 bytes [..., 16] -> its 32 quants: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_le(b: np.ndarray) -> np.ndarray:
    """4 bytes [..., 4] as a little-endian word's 32 bits [..., 32]."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """A K-quant super-block's 64 bytes of 2-bit quants [n, nsb, 64] -> its 256 quants, element
    128g + 32i + l = bits 2i, 2i + 1 of byte 32g + l (ggml's Q2_K and Q3_K low bits)."""
    n, nsb, _ = qs.shape
    return ((qs.reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(n, nsb, 256)


def _decode(qtype: str, blocks: np.ndarray, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGUF blocks [n, bytes] -> unsigned quants q [n, K / 32, 32] and the header's fields,
    each [n, records, F] (uint16 fp16 bits or uint8), in the record header's order."""
    t = TYPES[qtype]
    n = blocks.shape[0]
    b = blocks.reshape(n, k // t.block, t.block_bytes)
    if qtype in ("Q4_0", "IQ4_NL"):
        return _nibbles(b[..., 2:18]), [_u16(b, 0)]
    if qtype == "Q5_0":
        return _nibbles(b[..., 6:22]) | (_bits_le(b[..., 2:6]) << 4), [_u16(b, 0)]
    if qtype == "Q5_1":
        return _nibbles(b[..., 8:24]) | (_bits_le(b[..., 4:8]) << 4), [_u16(b, 0), _u16(b, 2)]
    nsb = b.shape[1]
    if qtype in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        qs = b[..., 16:144] if qtype == "Q4_K" else b[..., 48:176]
        qs = qs.reshape(n, nsb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)  # sub-block 2i + nibble
        q = (qs & 0x0F).reshape(n, nsb, 8, 32)
        if qtype == "Q5_K":
            q = q | (((b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        fields = [_u16(b, 0), _u16(b, 2), sc.reshape(n, nsb, 8), mn.reshape(n, nsb, 8)]
        return q.reshape(n, -1, 32), fields
    if qtype == "Q6_K":
        low = (b[..., 0:128].reshape(n, nsb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
        high = (b[..., 128:192].reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        q = low.reshape(n, nsb, 256) | (high.reshape(n, nsb, 256) << 4)  # element 128g + 64s + l, 128g + 32i + l
        return q.reshape(n, -1, 32), [_u16(b, 208), np.ascontiguousarray(b[..., 192:208])]
    if qtype == "Q2_K":  # scales[16] (sc | mn << 4 per 16 elements), qs[64] as Q3_K's, d, dmin
        return _crumbs(b[..., 16:80]).reshape(n, -1, 32), [_u16(b, 80), _u16(b, 82), np.ascontiguousarray(b[..., 0:16])]
    if qtype == "Q3_K":  # hmask[32], qs[64], scales[12], d: element 128g + 32i + l
        hbit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # element 32i + l: bit i of byte l
        q = _crumbs(b[..., 32:96]) | (hbit.reshape(n, nsb, 256) << 2)
        low = (b[..., None, 96:104] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F  # scale 8s + i: byte i >> 4s
        high = (b[..., None, 104:108] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # scale 4s + i
        sc = (low.reshape(n, nsb, 16) | (high.reshape(n, nsb, 16) << 4)).astype(np.int16) - 32
        return q.reshape(n, -1, 32), [_u16(b, 108), sc.astype(np.int8).view(np.uint8)]
    if qtype in GRID_TYPES:
        return _grid_decode(qtype, b)
    if qtype in ("Q4_G128", "Q4_G32"):  # per 32 of a block: 16 bytes, low nibbles k = j, high j + 16
        return _nibbles(b[..., 8:].reshape(n, -1, 16)), [_u32(b, 0), _u32(b, 4)]
    if qtype == "Q8_CH":
        return (b[..., 4:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, -1, 32), [_u32(b, 0)]
    assert qtype == "IQ4_XS", qtype
    scales_h = _u16(b, 2)  # [n, nsb, 1]
    low = _nibble_pairs(b[..., 4:8])  # sub-block 2i + nibble
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, nsb, 8]
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.int16) - 32
    return _nibbles(b[..., 8:136].reshape(n, nsb, 8, 16)).reshape(n, -1, 32), [_u16(b, 0), ls.astype(np.int8).view(np.uint8)]


# ---- the grid types: llama.cpp's block_iq* (ggml-common.h), gguf-py's grids and sign table ----

@functools.cache
def _grid(qtype: str) -> np.ndarray:
    """The type's grid as levels (the index of each value in gguf-py's grid_map): [G, width] uint8."""
    from gguf import quants

    cls = getattr(quants, "IQ1_S" if qtype == "IQ1_M" else qtype)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return np.searchsorted(np.asarray(cls.grid_map, dtype=np.float32), grid).astype(np.uint8)


def _ksign_bytes() -> bytes:
    """IQ2_XXS's ksigns: a 7-bit index -> 8 sign bits (the 8th the parity), as gguf-py has it."""
    from gguf import quants

    return quants.IQ2_XXS.ksigns


@functools.cache
def _ksigns() -> np.ndarray:
    """ksigns as bits [128, 8], the first weight's lowest."""
    return _bits_le(np.frombuffer(_ksign_bytes(), dtype=np.uint8)[:, None])


def _signed(levels: np.ndarray, negative: np.ndarray, nlevels: int) -> np.ndarray:
    """Grid levels with their signs (0/1) -> indices of the ascending signed table
    (quant_types.h): level l is nlevels + l, its negative nlevels - 1 - l."""
    lut = np.concatenate([nlevels + np.arange(8), nlevels - 1 - np.arange(8)]).astype(np.uint8)
    return lut[(negative << 3) | levels]


def _odd(scale: np.ndarray) -> np.ndarray:
    """A 3- or 4-bit scale s as the odd integer 2 s + 1 the kernels multiply d by, int8 bytes."""
    return (2 * scale.astype(np.int16) + 1).astype(np.int8).view(np.uint8)


# Per type: the bits of a group's signs in its code (grid index << bits | signs), its table's
# levels a sign (IQ1: none; its code's last bit is delta's sign instead). IQ2_S's groups are
# its grid rows' halves (a 2048 x 16 table, not 1024 x 256: one that stays in cache).
_SIGN_BITS = {"IQ2_XXS": 7, "IQ2_XS": 7, "IQ2_S": 4, "IQ3_XXS": 4, "IQ3_S": 4, "IQ1_S": 1, "IQ1_M": 1}
_LEVELS = {"IQ2_XXS": 3, "IQ2_XS": 3, "IQ2_S": 3, "IQ3_XXS": 8, "IQ3_S": 8}


@functools.cache
def _lut(qtype: str) -> np.ndarray:
    """Every code of a group (its grid index and signs) -> its weights' table indices [codes, width]."""
    grid, bits = _grid(qtype), _SIGN_BITS[qtype]
    if qtype == "IQ2_S":
        grid = grid.reshape(-1, 4)  # row 2 i + h: half h of grid row i
    codes = np.arange(grid.shape[0] << bits)
    levels, signs = grid[codes >> bits], codes & ((1 << bits) - 1)
    if qtype in ("IQ1_S", "IQ1_M"):  # 8 g + delta: 2 l + (delta > 0), the bit set for delta < 0
        return (2 * levels + 1 - signs[:, None]).astype(np.uint8)
    if qtype in ("IQ2_XXS", "IQ2_XS"):  # a 7-bit index into ksigns
        negative = _ksigns()[signs]
    else:  # the sign bits themselves, the group's first weight lowest
        negative = ((signs[:, None] >> np.arange(grid.shape[1])) & 1).astype(np.uint8)
    return _signed(levels, negative, _LEVELS[qtype])


def _grid_decode(qtype: str, b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """A grid type's blocks [n, nsb, bytes] -> table indices [n, K / 32, 32] and the header's
    fields: d (fp16 bits) and S = 2 s + 1 per 32 k (per 16 for IQ2_XS, IQ2_S, IQ1_M). Each
    group of 8 weights (IQ3: 4) has a code, its grid index and signs, looked up whole (_lut)."""
    n, nsb, _ = b.shape
    d = _u16(b, 0)
    if qtype == "IQ2_XXS":  # per 32: 4 grid bytes, then a word of 4 7-bit sign indices and the scale
        words = np.ascontiguousarray(b[..., 2:66]).view(np.uint32).reshape(n, nsb, 8, 2)
        grid_idx = b[..., 2:66].reshape(n, nsb, 8, 2, 4)[..., 0, :].astype(np.uint32)
        codes = grid_idx << 7 | ((words[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 127)
        scales = _odd(words[..., 1] >> 28)
    elif qtype == "IQ2_XS":  # a 16-bit word per 8: a 9-bit grid index, a 7-bit sign index; 4-bit scales
        words = np.ascontiguousarray(b[..., 2:66]).view(np.uint16)
        codes, scales = (words & 511) << 7 | words >> 9, _odd(_nibble_pairs(b[..., 66:74]))
    elif qtype == "IQ2_S":  # grid bytes, sign bytes, 2 high bits per index, 4-bit scales
        high = ((b[..., 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(n, nsb, 32)
        idx = b[..., 2:34].astype(np.uint16) | high.astype(np.uint16) << 8
        codes = (idx[..., None] << 1 | np.array([0, 1], np.uint16)) << 4 | _nibble_pairs(b[..., 34:66]).reshape(n, nsb, 32, 2)
        scales = _odd(_nibble_pairs(b[..., 74:82]))
    elif qtype == "IQ3_XXS":  # 64 grid bytes (4 weights each); per 32 a word of 4 sign indices and the scale
        aux = np.ascontiguousarray(b[..., 66:98]).view(np.uint32)  # [n, nsb, 8]
        signs = np.frombuffer(_ksign_bytes(), np.uint8)[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]
        nib = np.stack([signs & 15, signs >> 4], axis=-1).reshape(n, nsb, 64)  # a group of 8's two halves
        codes, scales = b[..., 2:66].astype(np.uint16) << 4 | nib, _odd(aux >> 28)
    elif qtype == "IQ3_S":  # grid bytes, their 9th bits, a sign bit per weight, a 4-bit scale per 32
        idx = b[..., 2:66].astype(np.uint16) | (_bits_le(b[..., 66:74]).astype(np.uint16) << 8)
        codes, scales = idx << 4 | _nibble_pairs(b[..., 74:106]), _odd(_nibble_pairs(b[..., 106:110]))
    elif qtype == "IQ1_S":  # grid bytes; per 32 a word: 3 high bits per index, the scale, delta's sign
        qh = np.ascontiguousarray(b[..., 34:50]).view(np.uint16)  # [n, nsb, 8]
        idx = b[..., 2:34].reshape(n, nsb, 8, 4).astype(np.uint16) | (
            ((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8)
        codes, scales = idx << 1 | (qh[..., None] >> 15), _odd((qh >> 12) & 7)
    else:  # IQ1_M: grid bytes, a nibble per index (3 high bits, delta's sign), 3-bit scales and d's bits
        nib = _nibble_pairs(b[..., 32:48])  # index 2i + h
        codes = (b[..., 0:32].astype(np.uint16) | (nib & 7).astype(np.uint16) << 8) << 1 | nib >> 3
        words = np.ascontiguousarray(b[..., 48:56]).view(np.uint16)  # [n, nsb, 4]
        scales = _odd(((words[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, nsb, 16))
        top = words >> 12
        d = (top[..., 0] | top[..., 1] << 4 | top[..., 2] << 8 | top[..., 3] << 12).astype(np.uint16)[..., None]
    return _lut(qtype)[codes].reshape(n, -1, 32), [d, scales]


def _nibble_pairs(scales: np.ndarray) -> np.ndarray:
    """Scale bytes [n, nsb, B] -> their 2 B nibbles, low then high of each byte in turn."""
    n, nsb, nbytes = scales.shape
    return ((scales[..., None] >> np.array([0, 4], np.uint8)) & 15).reshape(n, nsb, 2 * nbytes)


@functools.cache
def _repack_library() -> ctypes.CDLL:
    """cpu_kernels/repack.c: the bodies' bit scatter (records are read only by the C kernels,
    so where those cannot be built nothing is repacked)."""
    from ops import cpu_kernels

    lib = cpu_kernels.load("repack")
    if lib is None:
        raise RuntimeError("the C kernels cannot be built or run on this machine; GGUF records need them")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.repack_body.argtypes = [p, i64, i64, i32, p]
    lib.repack_body.restype = i32
    lib.body_bytes.argtypes = [i32]
    lib.body_bytes.restype = i32
    return lib


def _body(q: np.ndarray, qtype: str) -> np.ndarray:
    """Quants [n, nb, 32 k] -> the type's bodies [T, nb, bytes] (quant_types.h: its width
    qn_bits): the nibbles, then Q5's high-bit plane or Q6_K's 2-bit ones; 8-bit: Q8_0_I8's
    chunks; Q3_K's 3-bit: the 2-bit planes (of its low bits) and the 1-bit one, no nibbles;
    Q2_K's 2-bit: the 2-bit planes (cpu_kernels/repack.c)."""
    n, nb, _ = q.shape
    lib, code = _repack_library(), TYPES[qtype].code
    q = np.ascontiguousarray(q, dtype=np.uint8)
    out = np.empty((n // TILE, nb, lib.body_bytes(code)), np.uint8)
    if lib.repack_body(q.ctypes.data, n, nb, code, out.ctypes.data) != 0:
        raise ValueError(f"no {qtype} bodies for {n} rows")
    return out


def _pack_qn(qtype: str):
    def pack(blocks: np.ndarray, k: int) -> np.ndarray:
        q, fields = _decode(qtype, blocks, k)
        rt = TYPES[qtype]
        t, records = blocks.shape[0] // TILE, k // rt.k_multiple
        header = np.concatenate([_lanes(f) for f in fields], axis=-1)
        body = _body(q, qtype).reshape(t, records, -1)
        return np.concatenate([header, body], axis=-1)

    return pack


def _pack_f16(blocks: np.ndarray, k: int) -> np.ndarray:
    """w[32 k][32 n], two bytes each, per (tile, sub-block)."""
    n = blocks.shape[0]
    w = blocks.view(np.uint16).reshape(n // TILE, TILE, k // QBLOCK, QBLOCK).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(w).view(np.uint8).reshape(n // TILE, k // QBLOCK, -1)


_PACKERS = {
    **{(q, False): _pack_float(q) for q in ("Q4_1", "Q8_0")},
    **{(q, True): _pack_int(q) for q in ("Q4_1", "Q8_0")},
    **{(q, False): _pack_qn(q) for q in ("Q4_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
                                         "Q4_G128", "Q4_G32", "Q8_CH", "Q3_K", "Q2_K", *GRID_TYPES)},
    ("F16", False): _pack_f16,
    ("BF16", False): _pack_f16,
}


def q8_0_has_minus_128(w) -> bool:
    """Whether a Q8_0 weight has a quant of -128 (scanned a chunk of rows at a time)."""
    blocks = blocks_of(w)
    n, k = w.shape
    step = max(1, _CHUNK_WEIGHTS // k)
    for r0 in range(0, n, step):
        q = blocks[r0 : r0 + step].reshape(-1, k // QBLOCK, 34)[..., 2:]
        if (q == 0x80).any():
            return True
    return False
