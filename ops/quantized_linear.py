"""Linear layers and embeddings on the CPU over GGUF-quantized weights, computed on the file's
own blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, F16 and BF16,
and the i-quants' grid types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S decoded at
load into indices of a small table of their signed values (3 or 4 bits a weight: 1.25x-2.12x
their file's bytes, where float32 was 9-20x; `cpu_kernels/quant_types.h`).

A decode step reads every weight once, so on the CPU its floor is the weights' bytes over
memory bandwidth: 538 MB in float32 for the default model, 96 MB as the GGUF stores it.
`QuantLinear` keeps the file's blocks, repacked into tiles of 32 output rows
(`ops/quant_records.py`; the layouts in `cpu_kernels/quant_matmul.c`, `quant_matmul_int8.c`
and `quant_types.h`), and multiplies them with the activations in one of these `ACTIVATIONS`:

- "float32" (`cpu_kernels/quant_matmul.c`): the quants converted to float exactly and
  multiplied with x in float32, one sum per output and block of 32 taken over k in order,
  then scaled by the block's d (and its m times the block's sum of x added, for the types
  with one), as the integer kernels do: one FMA per weight and row, where multiplying
  gguf-py's dequantized weight (d*q + m) first took two. F16/BF16 take this arithmetic
  only (their values, exact in float32, a block's sum then added to y).
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
float32 for many rows). Either way a row's result does not depend on its batch, and every
ISA's build of a kernel gives the same bits. The kernels are C, built on first use for the
CPU's ISA (`ops/cpu_kernels`); `available()` is False where there is no compiler or no AVX2,
and the runner then falls back to float32 weights.

The K-quants' and IQ4_XS's sub-block scales (d times a 6-bit scale, dmin times a 6-bit min)
are formed in float32 in the kernels, where they are exact, from the file's fp16 and integer
fields; Q2_K, Q3_K and Q6_K have a scale per 16 weights (Q2_K a min per 16 too). How each type's weights enter the arithmetic is in
`cpu_kernels/quant_types.h`.

The interface the loader and the capacity planner use (worker/weights, worker/plan.py):

- `QuantizedWeight(qtype, blocks, shape)`: the file's blocks, uint8 [out_features, bytes per
  row] (F16 also as float16 [out_features, in_features], as the GGUF reader gives it).
- `supports(qtype, shape)`: a native kernel runs it; the loader keeps such tensors quantized
  (no float32 copy) and dequantizes the rest. Every type needs out_features % 32 == 0 (the
  tile); in_features % 32 == 0 for the 32-blocks and F16/BF16, % 256 == 0 for Q4_K, Q5_K,
  Q2_K, Q3_K, Q6_K, IQ4_XS and the grid types.
- `QuantLinear(weight, bias, activations)`, `QuantEmbedding(weight)` and
  `QuantEmbedding.of_head(head, weight)` (a tied head's records, held once), for every type;
  `activations_for(weight, activations)` (float32 for F16/BF16 and a Q8_0 weight with a -128
  quant, else the asked-for arithmetic); `supports_int8(weight)`;
  `held_bytes(qtype, gguf_nbytes, activations)`: the records' bytes, `HELD_RATIO[qtype]`
  times the file's (1 for most types; Q3_K 1.036, Q4_K 1.028, Q5_K 1.023, IQ4_XS 1.015: their 6-bit
  sub-scales held a byte each; the grid types 1.25 (IQ3_S) to 2.12 (IQ1_S)); `dequantize(weight)`: gguf-py's float32 weight (the
  reference); `quantize_linears(model, quantized, activations)`.
- A QuantLinear keeps no reference to `weight.blocks` once built (the loader releases the
  file's pages tensor by tensor), and repacks a few hundred rows at a time (temporaries of a
  few MB whatever the weight's size).
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
from ops.quant_records import TILE, TYPES, blocks_of, q8_0_has_minus_128, q_fields, repacked

# Activation arithmetic -> bytes per activation in the integer kernels (0: float32).
ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2, "int24": 3}
# Held records' bytes per byte of the file's blocks, by type.
HELD_RATIO = {name: t.record / t.file_record for name, t in TYPES.items()}


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF weight as the file stores it: `blocks` is [out_features, bytes per row] uint8
    (F16 may be float16 [out_features, in_features]); `qtype` is gguf's type name."""

    qtype: str  # "Q4_K", "Q6_K", "IQ4_XS", "F16", ... (a key of quant_records.TYPES)
    blocks: np.ndarray
    shape: tuple[int, int]  # (out_features, in_features)


def supports(qtype: str, shape: tuple[int, ...]) -> bool:
    """Whether a native kernel takes a `qtype` weight of `shape` (see the top)."""
    t = TYPES.get(qtype)
    return (t is not None and len(shape) == 2 and shape[0] > 0 and shape[0] % TILE == 0
            and shape[1] > 0 and shape[1] % t.k_multiple == 0)


def _kernel_name(qtype: str, integer: bool) -> str:
    return f"{qtype.lower()}{'_i8' if integer else ''}_matmul"


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("quant_matmul")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int  # pointers as the tensors' data_ptr()
        for qtype in TYPES:
            fn = getattr(lib, _kernel_name(qtype, False))
            fn.argtypes = [p, i32, i32, p, i32, p, i32]
            fn.restype = ctypes.c_int
        lib.quant_rows.argtypes = [p, i32, i32, p, i32, p]
        lib.quant_rows.restype = ctypes.c_int
        lib.quant_tile_bytes.argtypes = [i32, i32]
        lib.quant_tile_bytes.restype = ctypes.c_int
    return lib


@functools.cache
def _library_int8() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("quant_matmul_int8")
    if lib is not None:
        p, i32 = ctypes.c_void_p, ctypes.c_int
        for qtype, t in TYPES.items():
            if t.int_code >= 0:
                fn = getattr(lib, _kernel_name(qtype, True))
                fn.argtypes = [p, i32, i32, p, i32, p, i32, i32]
                fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def _check_supported(w: QuantizedWeight) -> None:
    if not supports(w.qtype, w.shape):
        raise ValueError(f"cannot repack a {w.qtype} weight of shape {w.shape}")


def repack(w: QuantizedWeight) -> torch.Tensor:
    """GGUF blocks -> the float32 kernels' tile records (the layouts: quant_matmul.c for Q4_1
    and Q8_0, quant_types.h for the others), as uint8."""
    _check_supported(w)
    return repacked(w, integer=False)


def _quants(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Q4_1/Q8_0: block scales d [T, nb, 32 n] fp16, offsets m (Q4_1) and quants [T, nb, 32 n, 32 k]."""
    return q_fields(blocks_of(w), w.qtype, w.shape[1])


def supports_int8(w: QuantizedWeight) -> bool:
    """Whether `repack_int8` takes `w`: every type but F16/BF16, and a Q8_0 weight only without
    a quant of -128 (AVX2's sign trick cannot take one; gguf's own quantizer never writes it)."""
    if not supports(w.qtype, w.shape) or TYPES[w.qtype].int_code < 0:
        return False
    return w.qtype != "Q8_0" or not q8_0_has_minus_128(w)


def repack_int8(w: QuantizedWeight) -> torch.Tensor:
    """GGUF blocks -> the integer kernels' tile records (layouts in quant_matmul_int8.c for Q4_1
    and Q8_0, quant_types.h for the others, the float32 kernels' own), as uint8."""
    if not supports_int8(w):
        raise ValueError(f"cannot repack a {w.qtype} weight of shape {w.shape} for integer activations")
    return repacked(w, integer=True)


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
        t = TYPES[weight.qtype]
        # the kernels' qtype code (decoder.c's qlinear): Q4_1/Q8_0 have a layout per arithmetic
        self.code = t.int_code if self.planes else t.code
        self.packed = repack_int8(weight) if self.planes else repack(weight)
        self.bias = None if bias is None else bias.detach().to(torch.float32).clone()
        fn = getattr(lib, _kernel_name(weight.qtype, self.planes > 0))
        self._fn = functools.partial(_with_planes, fn, self.planes) if self.planes else fn

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
    """`nn.Embedding` over a weight's tile records (`repack` or `repack_int8`), the same
    records a tied head's `QuantLinear` multiplies with, so a tied model holds its table once.
    A looked-up row is dequantized as gguf-py does (its products and sums in its order, in
    float32): the float32 table's row bit for bit (`quant_rows` in cpu_kernels/quant_matmul.c,
    which decoder.c's lookup also calls). Any type `supports` takes."""

    def __init__(self, weight: QuantizedWeight, packed: torch.Tensor | None = None,
                 integer_layout: bool = False) -> None:
        super().__init__()
        _check_supported(weight)
        lib = _library()
        assert lib is not None, "QuantEmbedding needs the compiled kernel (see available())"
        self._lib = lib
        self.qtype = weight.qtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.integer_layout = integer_layout
        t = TYPES[weight.qtype]
        self.code = t.int_code if integer_layout else t.code
        assert self.code >= 0, f"{weight.qtype} has no integer layout"
        if packed is None:
            packed = repack_int8(weight) if integer_layout else repack(weight)
        assert packed.numel() == weight.shape[0] // TILE * lib.quant_tile_bytes(self.code, weight.shape[1])
        self.packed = packed

    @classmethod
    def of_head(cls, head: QuantLinear, weight: QuantizedWeight) -> QuantEmbedding:
        """The lookup sharing a tied head's records."""
        assert head.qtype == weight.qtype and (head.out_features, head.in_features) == weight.shape
        return cls(weight, head.packed, head.integer_layout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings})")
        out = torch.empty(flat.numel(), self.embedding_dim)
        if flat.numel():
            rc = self._lib.quant_rows(self.packed.data_ptr(), self.code, self.embedding_dim, flat.data_ptr(),
                                      flat.numel(), out.data_ptr())
            assert rc == 0, rc
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype}"


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
    `activations` (resolved; every type's records are the same size in both arithmetics):
    `HELD_RATIO[qtype]` times the file's bytes. The layouts hold the blocks' scales, mins and
    quants in another order, the file's bytes for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q6_K,
    F16 and BF16; Q3_K (+3.6%), Q4_K (+2.8%), Q5_K (+2.3%) and IQ4_XS (+1.5%) hold their 6-bit sub-block
    scales and mins a byte each; the grid types each weight as a 3- or 4-bit table index (IQ3_S
    1.25x the file, IQ3_XXS 1.41x, IQ2_S 1.39x, IQ2_XS 1.54x, IQ2_XXS 1.61x, IQ1_M 2.04x, IQ1_S 2.12x)."""
    t = TYPES[qtype]
    return gguf_nbytes * t.record // t.file_record


def activations_for(weight: QuantizedWeight, activations: str) -> str:
    """`activations` resolved, or float32 where the integer kernels cannot take `weight`."""
    activations = resolve_activations(activations)
    return activations if ACTIVATIONS[activations] == 0 or supports_int8(weight) else "float32"


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight, as gguf-py computes it (the reference for tests)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = gguf_dequantize(blocks_of(weight), GGMLQuantizationType[weight.qtype])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(weight.shape))
