"""Linear layers on the CPU over GGUF-quantized weights (Q4_1, Q8_0).

A decode step reads every weight once, so on the CPU its floor is the weights' bytes over
memory bandwidth: 538 MB in float32 for the default model, 96 MB as the GGUF stores it.
`QuantLinear` keeps the file's blocks, repacked into tiles, and multiplies them with the
activations in one of these `ACTIVATIONS`:

- "float32" (`cpu_kernels/quant_matmul.c`): the quants converted to float exactly and
  multiplied with x in float32, one sum per output and block of 32 taken over k in order,
  then scaled by the block's d (and its m times the block's sum of x added, for Q4_1), as
  the integer kernels do: one FMA per weight and row, where multiplying gguf-py's
  dequantized weight (d*q + m) first took two.
- "int8", "int16", "int24" (`cpu_kernels/quant_matmul_int8.c`): each row of x written per
  block of 32 as integers of 1, 2 or 3 bytes (relative to the block's largest) and multiplied
  with exact integer dot products (vpdpbusd, vpmaddubsw), as llama.cpp does with int8: a few
  times less arithmetic than float32. int8 is llama.cpp's arithmetic and loses about 1/254 of
  a block's largest value per element; int24 keeps 23 bits of it, about float32's precision.
  int16 (the default with VNNI) keeps 15: on the default model its prompt logprobs are within
  1e-2 of transformers' float32 (transformers' own bfloat16 is within 0.3), its greedy tokens
  are transformers' on the 10 parity prompts over 64 tokens (int8's leave them on 9 of 10),
  and its 64-row steps run 1.23x faster than int24's, its one-row steps 1.04x
  (`benchmarks/activations.py`, BENCHMARKS.md).

"auto" is int16 where the CPU has AVX-512 VNNI (there it is faster than float32 at one row
and at 64), float32 elsewhere (without VNNI the integer kernels take more instructions than
float32 for many rows). Either way a row's result does not depend on its batch, and the AVX2 and AVX-512 builds of
a kernel give the same bits. The kernels are C, built on first use for the CPU's ISA
(`ops/cpu_kernels`); `available()` is False where there is no compiler or no AVX2, and the
runner then falls back to float32 weights.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ops import cpu_kernels

TILE = 32  # output rows per tile
QBLOCK = 32  # weights per quantization block (both types)
# Bytes of one GGUF block, and of one repacked (tile, block) record.
_GGUF_BLOCK = {"Q4_1": 20, "Q8_0": 34}
_RECORD = {"Q4_1": 640, "Q8_0": 1088}
_RECORD_INT8 = {"Q4_1": 640, "Q8_0": 1088}
# Activation arithmetic -> bytes per activation in the integer kernels (0: float32).
ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2, "int24": 3}



@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF weight as the file stores it: `blocks` is [out_features, bytes per row]."""

    qtype: str  # "Q4_1" | "Q8_0"
    blocks: np.ndarray  # uint8
    shape: tuple[int, int]  # (out_features, in_features)


def supports(qtype: str, shape: tuple[int, ...]) -> bool:
    return qtype in _RECORD and len(shape) == 2 and shape[0] % TILE == 0 and shape[1] % QBLOCK == 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("quant_matmul")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int  # pointers as the tensors' data_ptr()
        for name in ("q4_1_matmul", "q8_0_matmul"):
            fn = getattr(lib, name)
            fn.argtypes = [p, i32, i32, p, i32, p, i32]
            fn.restype = ctypes.c_int
    return lib


@functools.cache
def _library_int8() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("quant_matmul_int8")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int
        for name in ("q4_1_i8_matmul", "q8_0_i8_matmul"):
            fn = getattr(lib, name)
            fn.argtypes = [p, i32, i32, p, i32, p, i32, i32]
            fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def repack(w: QuantizedWeight) -> torch.Tensor:
    """GGUF blocks [N, K/32 blocks] -> tile records (layout in quant_matmul.c), as uint8."""
    n, k = w.shape
    if not supports(w.qtype, w.shape):
        raise ValueError(f"cannot repack a {w.qtype} weight of shape {w.shape}")
    nb, size = k // QBLOCK, _GGUF_BLOCK[w.qtype]
    blocks = np.ascontiguousarray(w.blocks).reshape(n // TILE, TILE, nb, size)

    def halves(lo: int) -> np.ndarray:  # the fp16 scale at bytes lo:lo+2 -> [T, nb, 32 n] bytes
        h = blocks[..., lo : lo + 2].copy().view(np.uint16)[..., 0].transpose(0, 2, 1)
        return np.ascontiguousarray(h).view(np.uint8)

    d = halves(0)
    if w.qtype == "Q4_1":
        m = halves(2)
        qs = blocks[..., 4:20]  # [T, n, nb, 16]: byte j holds k = j (low) and k = j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [T, n, nb, 32 k]
        q = q.transpose(0, 2, 3, 1)  # [T, nb, k, n]
        packed = q[..., :16] | (q[..., 16:] << 4)  # [T, nb, k, 16]
        parts = [d, m, packed.reshape(*packed.shape[:2], -1)]
    else:
        q = blocks[..., 2:34].transpose(0, 2, 3, 1)  # [T, nb, k, n] int8 as uint8
        parts = [d, np.ascontiguousarray(q).reshape(*q.shape[:2], -1)]
    parts = [np.ascontiguousarray(p).reshape(n // TILE, nb, -1) for p in parts]
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == _RECORD[w.qtype], out.shape
    return torch.from_numpy(np.ascontiguousarray(out).reshape(-1))


def _quants(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Block scales d [T, nb, 32 n] fp16, offsets m (Q4_1) and quants [T, nb, 32 n, 32 k]."""
    n, k = w.shape
    nb, size = k // QBLOCK, _GGUF_BLOCK[w.qtype]
    blocks = np.ascontiguousarray(w.blocks).reshape(n // TILE, TILE, nb, size).transpose(0, 2, 1, 3)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if w.qtype == "Q4_1":
        qs = blocks[..., 4:20]  # byte j holds k = j (low nibble) and k = j + 16 (high)
        return d, blocks[..., 2:4].copy().view(np.float16)[..., 0], np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return d, None, blocks[..., 2:34].view(np.int8)


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of `a` in its index order: [..., last] -> [..., last * itemsize] uint8."""
    return np.ascontiguousarray(a).view(np.uint8)


def supports_int8(w: QuantizedWeight) -> bool:
    """Whether `repack_int8` takes `w` (AVX2's sign trick cannot take a Q8_0 quant of -128,
    which gguf's own quantizer never writes)."""
    if not supports(w.qtype, w.shape):
        return False
    return w.qtype == "Q4_1" or not (_quants(w)[2] == -128).any()


def repack_int8(w: QuantizedWeight) -> torch.Tensor:
    """GGUF blocks -> the int8 kernel's tile records (layout in quant_matmul_int8.c), as
    uint8: chunks of 16 outputs x 4 consecutive k, one output's 4 quants to a 32-bit lane."""
    if not supports_int8(w):
        raise ValueError(f"cannot repack a {w.qtype} weight of shape {w.shape} for integer activations")
    d, m, q = _quants(w)
    t, nb = d.shape[:2]
    if w.qtype == "Q4_1":
        # k = 8p + 4s + j: s = 0 goes to the low nibble, s = 1 to the high one.
        q = q.reshape(t, nb, 2, 16, 4, 2, 4).transpose(0, 1, 2, 4, 3, 6, 5)  # [t, nb, h, p, n, j, s]
        chunks = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8)
        parts = [_bytes(d), _bytes(m), chunks]
    else:
        # q + 128: the unsigned side of vpdpbusd (quant_matmul_int8.c's top)
        q = (q.astype(np.int16) + 128).astype(np.uint8)
        q = q.reshape(t, nb, 2, 16, 8, 4).transpose(0, 1, 2, 4, 3, 5)  # [t, nb, h, p, n, j], k = 4p + j
        parts = [_bytes(d), q]
    out = np.concatenate([np.ascontiguousarray(p).reshape(t, nb, -1) for p in parts], axis=-1)
    assert out.shape[-1] == _RECORD_INT8[w.qtype], out.shape
    return torch.from_numpy(np.ascontiguousarray(out).reshape(-1))


class QuantLinear(nn.Module):
    """`y = x @ W.T + bias` for x: [rows, in_features] float32, W kept quantized."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 activations: str = "float32") -> None:
        """`activations`: one of ACTIVATIONS (see the top); an integer one needs a weight
        that satisfies `supports_int8`."""
        super().__init__()
        self.planes = ACTIVATIONS[activations]
        lib = _library_int8() if self.planes else _library()
        assert lib is not None, "QuantLinear needs the compiled kernel (see available())"
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.activations = activations
        self.packed = repack_int8(weight) if self.planes else repack(weight)
        self.bias = None if bias is None else bias.detach().to(torch.float32).clone()
        if self.planes:
            fn = lib.q4_1_i8_matmul if weight.qtype == "Q4_1" else lib.q8_0_i8_matmul
            self._fn = functools.partial(_with_planes, fn, self.planes)
        else:
            self._fn = lib.q4_1_matmul if weight.qtype == "Q4_1" else lib.q8_0_matmul

    @property
    def integer_layout(self) -> bool:
        """Whether `packed` is in the integer kernels' layout (`repack_int8`)."""
        return self.planes > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
        shape = x.shape
        x = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            rc = self._fn(x.data_ptr(), x.shape[0], self.in_features, self.packed.data_ptr(),
                          self.out_features, y.data_ptr(), torch.get_num_threads())
            if rc:
                raise RuntimeError(f"quantized matmul failed ({rc})")
        if self.bias is not None:
            y += self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}, "
                f"{self.activations} activations")


def _with_planes(fn: Callable[..., int], planes: int, *args: int) -> int:
    """An integer kernel's call with the planes argument last."""
    return fn(*args, planes)


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a Q8_0 weight's tile records (`repack` or `repack_int8`), the same
    records a tied head's `QuantLinear` multiplies with, so a tied model holds its table once.
    A looked-up row is dequantized as gguf-py does (`d*q`, exact in float32): the float32
    table's row bit for bit. Row r lives in tile r // 32, lane n = r % 32 of every block's
    record::

        float32 layout:  d[32 lanes] fp16 | q[32 k][32 lanes] int8
                         row r, block b: d[t, b, n] * q[t, b, :, n]
        integer layout:  d[32 lanes] fp16 | u[2 h][8 p][16 n'][4 j] uint8 (u = q + 128)
                         row r, block b: d[t, b, n] * (u[t, b, n // 16, :, n % 16, :] - 128)  (k = 4p + j)
    """

    def __init__(self, weight: QuantizedWeight, packed: torch.Tensor | None = None,
                 integer_layout: bool = False) -> None:
        super().__init__()
        assert weight.qtype == "Q8_0", weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.integer_layout = integer_layout
        if packed is None:
            packed = repack_int8(weight) if integer_layout else repack(weight)
        self.packed = packed
        records = self.packed.view(self.num_embeddings // TILE, self.embedding_dim // QBLOCK, -1)
        self._d = records[:, :, : 2 * TILE].view(torch.float16)  # [T, nb, 32 lanes]
        if integer_layout:
            self._q = records[:, :, 2 * TILE :].unflatten(-1, (2, 8, 16, 4))  # uint8: q + 128
        else:
            self._q = records[:, :, 2 * TILE :].view(torch.int8).unflatten(-1, (QBLOCK, TILE))

    @classmethod
    def of_head(cls, head: QuantLinear, weight: QuantizedWeight) -> QuantEmbedding:
        """The lookup sharing a tied head's records."""
        assert head.qtype == weight.qtype and (head.out_features, head.in_features) == weight.shape
        return cls(weight, head.packed, head.integer_layout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        tile, lane = flat // TILE, flat % TILE
        if self.integer_layout:
            q = self._q[tile, :, lane // 16, :, lane % 16, :].flatten(-2).to(torch.int16) - 128  # [R, nb, 32 k]
        else:
            q = self._q[tile, :, :, lane]
        rows = self._d[tile, :, lane].float().unsqueeze(-1) * q.float()
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0"


def quantize_linears(model: nn.Module, quantized: Mapping[str, QuantizedWeight],
                     activations: str = "float32") -> int:
    """Replace every `nn.Linear` of `model` whose name has a weight in `quantized` by a
    `QuantLinear` of it (with integer `activations` where the weight allows, else float32);
    returns how many were replaced (0 when already done). A linear an earlier call quantized
    for other activations is refused: the swap is in place, so a second engine on the same
    load would otherwise run the first one's arithmetic without a word."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear) and name in quantized:
            want = activations_for(quantized[name], activations)
            if module.activations != want:
                raise ValueError(f"{name} was quantized for {module.activations} activations by an earlier "
                                 f"engine on this load; {want} needs a load of its own (load_model again)")
        if isinstance(module, nn.Linear) and name in quantized:
            qw = quantized[name]
            assert qw.shape == tuple(module.weight.shape), (name, qw.shape, module.weight.shape)
            parent, _, child = name.rpartition(".")
            layer = QuantLinear(qw, module.bias, activations_for(qw, activations))
            setattr(model.get_submodule(parent), child, layer)
            count += 1
    return count


def resolve_activations(activations: str) -> str:
    """One of ACTIVATIONS for a name of them or "auto" (see the top)."""
    if activations == "auto":
        return "int16" if cpu_kernels.isa() == "avx512-vnni" else "float32"
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be auto or one of {', '.join(ACTIVATIONS)}, not {activations!r}")
    return activations


def held_bytes(qtype: str, gguf_nbytes: int, activations: str) -> int:
    """Bytes a GGUF weight of `gguf_nbytes` holds once repacked into the tile records of
    `activations` (resolved). Every layout holds the GGUF blocks' scales, mins and quants in
    another order, so today this is `gguf_nbytes` (the integer kernels' Q8_0 records held each
    block's sums too until session 25); a layout that adds bytes changes it here."""
    record = _RECORD_INT8 if ACTIVATIONS[activations] else _RECORD
    return gguf_nbytes * record[qtype] // (_GGUF_BLOCK[qtype] * TILE)


def activations_for(weight: QuantizedWeight, activations: str) -> str:
    """`activations` resolved, or float32 where the integer kernels cannot take `weight`."""
    activations = resolve_activations(activations)
    return activations if ACTIVATIONS[activations] == 0 or supports_int8(weight) else "float32"


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, as gguf-py computes it (the reference for tests)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = gguf_dequantize(weight.blocks, GGMLQuantizationType[weight.qtype])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(weight.shape))
